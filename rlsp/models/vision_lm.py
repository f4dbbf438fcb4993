"""VisionLogprobModel: a HF vision-language model (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE; Qwen3.5 and Qwen3.5-MoE loaded
with their tower) on this rank's shard of a packed stream, returning token logprobs.

It keeps `rlsp.models.lm.TokenLogprobModel`'s calling convention and output layer, and also takes the micro-batch's
images (`MultiModalRows`, rlsp.models.vision_inputs). The images reach the text model through
`rlsp.models.vision_tower.VisionInputs` (3-D rope positions before sharding, one tower pass per image spread over the
sequence-parallel ranks, visual tokens placed at the rank's image placeholders), the path the vision-language critic
(`rlsp.models.value.VisionValueModel`) shares.

Legend: S local tokens, H text hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from rlsp.models.lm import TokenLogprobModel, check_local_inputs, compute_hidden_states
from rlsp.models.vision_inputs import TOWER_FAMILIES, MultiModalRows
from rlsp.models.vision_tower import VisionInputs, assign_images, check_tower_family
from rlsp.parallel.ulysses import SPContext

__all__ = ["VisionLogprobModel", "assign_images", "build_logprob_model"]


class VisionLogprobModel(VisionInputs, TokenLogprobModel):
    """Wraps a HF `*ForConditionalGeneration` of TOWER_FAMILIES (`self.lm`); forward also takes `multi_modal`."""

    def __init__(self, lm: nn.Module, chunk_size: int = 1024, compiled: bool = False,
                 freeze_vision_tower: bool = False) -> None:
        check_tower_family(lm, "text models: rlsp.models.lm.TokenLogprobModel")
        super().__init__(lm, chunk_size, compiled)
        self.freeze_vision_tower = freeze_vision_tower
        if freeze_vision_tower:
            self.freeze_tower()

    @property
    def vl_model(self) -> nn.Module:
        return self.lm.model

    def forward(self, input_ids_S: torch.Tensor, position_ids_S: torch.Tensor, labels_S: torch.Tensor,
                sp_context: SPContext, multi_modal: MultiModalRows | None = None, temperature: float = 1.0,
                with_entropy: bool = False, with_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        """TokenLogprobModel.forward with the micro-batch's images (None: text-only rows)."""
        check_local_inputs(sp_context, input_ids=input_ids_S, position_ids=position_ids_S, labels=labels_S)
        self.check_no_tp()
        inputs = self.vision_inputs(input_ids_S, position_ids_S, sp_context, multi_modal)
        hidden_SH = compute_hidden_states(self.decoder, input_ids_S, position_ids_S, sp_context, inputs=inputs)
        return self.head_outputs(hidden_SH, labels_S, temperature, with_entropy, with_sum_pi_squared)


def build_logprob_model(lm: nn.Module, *, chunk_size: int = 1024, compiled: bool = False,
                        freeze_vision_tower: bool = False) -> TokenLogprobModel:
    """The policy head model of a loaded `lm` (rlsp.models.loading.load_causal_lm): VisionLogprobModel for the
    vision-language families (a Qwen3.5 wrapper loaded with its tower), else TokenLogprobModel (which has no vision
    tower: `freeze_vision_tower` is moot)."""
    if getattr(lm.config, "model_type", None) in TOWER_FAMILIES:
        return VisionLogprobModel(lm, chunk_size, compiled, freeze_vision_tower=freeze_vision_tower)
    return TokenLogprobModel(lm, chunk_size, compiled)
