"""ValueModel: the critic — a HF decoder backbone plus a scalar value head, one value per token.

It follows the calling convention of `rlsp.models.lm` (local shards of a packed stream in, a dict of
per-token fp32 tensors out), so the engine runs it through the same packed, Ulysses-sharded path as
the policy. The value at stream position t is V(s_t), the value of the state that *predicts* token
t+1 — the same alignment as a logprob, so `rlsp.engine.stream.stream_to_response` gives the value of
the state before each response token, as PPO's GAE uses it. Under tensor + sequence parallelism
(`rlsp.parallel.tensor_parallel`) the values cover the tp rank's [S/tp] block of the shard.

Legend: S local tokens, H hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlsp.models.lm import check_local_inputs, compute_hidden_states
from rlsp.parallel.tensor_parallel import TPInfo, tp_local_param
from rlsp.parallel.ulysses import SPContext

VALUE_HEAD = "value_head"


class ValueModel(nn.Module):
    """`backbone` is a HF base model (e.g. `Qwen2Model`); `value_head` maps a hidden state to a scalar."""

    def __init__(self, backbone: nn.Module, init_std: float | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = int(backbone.config.hidden_size)
        self.value_head = nn.Linear(hidden, 1, dtype=next(backbone.parameters()).dtype)
        std = init_std if init_std is not None else float(getattr(backbone.config, "initializer_range", 0.02))
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
    ) -> dict[str, torch.Tensor]:
        """Local shards [S] in -> {"values": [S] fp32} ([S/tp] under tensor + sequence parallelism).
        `labels_S` is unused (kept for the shared signature)."""
        del labels_S
        check_local_inputs(sp_context, input_ids=input_ids_S, position_ids=position_ids_S)
        tp = self.tp_info
        hidden_SH = compute_hidden_states(self.backbone, input_ids_S, position_ids_S, sp_context, tp)
        head = self.value_head
        values_S = F.linear(hidden_SH, tp_local_param(head.weight, tp), tp_local_param(head.bias, tp))
        values_S = values_S.squeeze(-1).float()
        # A fresh tensor, not a view of the head's output: FSDP hooks backward on the returned tensors.
        return {"values": values_S.clone() if values_S._base is not None else values_S}
