"""ValueModel: the critic — a HF decoder backbone plus a scalar value head, one value per token; VisionValueModel: the
same over a HF vision-language base model, taking the rows' images as the policy does.

It follows the calling convention of `rlsp.models.lm` (local shards of a packed stream in, a dict of
per-token fp32 tensors out), so the engine runs it through the same packed, Ulysses-sharded path as
the policy. The value at stream position t is V(s_t), the value of the state that *predicts* token
t+1 — the same alignment as a logprob, so `rlsp.engine.stream.stream_to_response` gives the value of
the state before each response token, as PPO's GAE uses it. Under tensor + sequence parallelism
(`rlsp.parallel.tensor_parallel`) the values cover the tp rank's [S/tp] block of the shard.

VisionValueModel's backbone is the vision-language base model (`visual` tower + `language_model`, no output layer):
its decoder inputs come from `rlsp.models.vision_tower.VisionInputs`, the path `rlsp.models.vision_lm`'s policy takes
(the same tower pass, embedding scatter, 3-D rope and sequence-parallel sharding); the value head reads the text
model's final hidden states. Parameter names: `backbone.visual.*`, `backbone.language_model.*`, `value_head.*`.

Legend: S local tokens, H hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlsp.models.lm import check_local_inputs, compute_hidden_states
from rlsp.models.vision_inputs import TOWER_FAMILIES, MultiModalRows
from rlsp.models.vision_tower import VisionInputs, check_tower_family
from rlsp.parallel.tensor_parallel import TPInfo, tp_local_param
from rlsp.parallel.ulysses import SPContext

VALUE_HEAD = "value_head"


class ValueModel(nn.Module):
    """`backbone` is a HF base model (e.g. `Qwen2Model`); `value_head` maps a hidden state to a scalar."""

    def __init__(self, backbone: nn.Module, init_std: float | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        text_config = self.decoder.config
        hidden = int(text_config.hidden_size)
        self.value_head = nn.Linear(hidden, 1, dtype=next(backbone.parameters()).dtype)
        std = init_std if init_std is not None else float(getattr(text_config, "initializer_range", 0.02))
        nn.init.normal_(self.value_head.weight, std=std)
        nn.init.zeros_(self.value_head.bias)
        self.tp_info: TPInfo | None = None  # set by rlsp.parallel.tensor_parallel.apply_tensor_parallel

    @property
    def decoder(self) -> nn.Module:
        return self.backbone

    @property
    def config(self):
        return self.backbone.config

    def forward(
        self,
        input_ids_S: torch.Tensor,
        position_ids_S: torch.Tensor,
        labels_S: torch.Tensor | None,
        sp_context: SPContext,
        multi_modal: MultiModalRows | None = None,
    ) -> dict[str, torch.Tensor]:
        """Local shards [S] in -> {"values": [S] fp32} ([S/tp] under tensor + sequence parallelism).
        `labels_S` is unused (kept for the shared signature)."""
        del labels_S
        check_local_inputs(sp_context, input_ids=input_ids_S, position_ids=position_ids_S)
        if multi_modal is not None:
            name = type(self.backbone).__name__
            raise ValueError(f"the rows carry images but the critic's backbone {name} is a text "
                             "model; images reach a vision-language critic (VisionValueModel, loaded with "
                             "load_backbone(..., vision_tower=True)); a text critic is given the rows without them")
        hidden_SH = compute_hidden_states(self.backbone, input_ids_S, position_ids_S, sp_context, self.tp_info)
        return self.value_outputs(hidden_SH)

    def value_outputs(self, hidden_SH: torch.Tensor) -> dict[str, torch.Tensor]:
        """The value head on final hidden states [S, H] ([S/tp, H]): {"values": [S] fp32}."""
        tp = self.tp_info
        head = self.value_head
        values_S = F.linear(hidden_SH, tp_local_param(head.weight, tp), tp_local_param(head.bias, tp))
        values_S = values_S.squeeze(-1).float()
        # A fresh tensor, not a view of the head's output: FSDP hooks backward on the returned tensors.
        return {"values": values_S.clone() if values_S._base is not None else values_S}


class VisionValueModel(VisionInputs, ValueModel):
    """`backbone` is a HF vision-language base model of TOWER_FAMILIES (e.g. `Qwen2_5_VLModel`: `visual` +
    `language_model`); forward also takes the micro-batch's images (`multi_modal`, None: text-only rows)."""

    def __init__(self, backbone: nn.Module, init_std: float | None = None, freeze_vision_tower: bool = False) -> None:
        check_tower_family(backbone, "text critics: ValueModel")
        super().__init__(backbone, init_std)
        self.freeze_vision_tower = freeze_vision_tower
        if freeze_vision_tower:
            self.freeze_tower()

    @property
    def vl_model(self) -> nn.Module:
        return self.backbone

    def forward(self, input_ids_S: torch.Tensor, position_ids_S: torch.Tensor, labels_S: torch.Tensor | None,
                sp_context: SPContext, multi_modal: MultiModalRows | None = None) -> dict[str, torch.Tensor]:
        """ValueModel.forward with the micro-batch's images."""
        del labels_S
        check_local_inputs(sp_context, input_ids=input_ids_S, position_ids=position_ids_S)
        self.check_no_tp()
        inputs = self.vision_inputs(input_ids_S, position_ids_S, sp_context, multi_modal)
        hidden_SH = compute_hidden_states(self.decoder, input_ids_S, position_ids_S, sp_context, inputs=inputs)
        return self.value_outputs(hidden_SH)


def build_value_model(backbone: nn.Module, init_std: float | None = None,
                      freeze_vision_tower: bool = False) -> ValueModel:
    """The critic's head model over a loaded backbone (rlsp.models.loading.load_backbone): VisionValueModel for a
    vision-language base model (loaded with its tower), else ValueModel (`freeze_vision_tower` must then be False)."""
    model_type: Any = getattr(backbone.config, "model_type", None)
    if model_type in TOWER_FAMILIES:
        return VisionValueModel(backbone, init_std, freeze_vision_tower)
    if freeze_vision_tower:
        raise ValueError(f"freeze_vision_tower=True: the critic's backbone ({model_type}) has no vision tower; legal: "
                         f"False, or a vision-language model of {list(TOWER_FAMILIES)}")
    return ValueModel(backbone, init_std)
