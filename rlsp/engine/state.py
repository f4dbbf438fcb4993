"""The state half of `rlsp.engine.fsdp_engine.FSDPEngine`: checkpoint state (sharded DCP state dicts) and the full,
HF-named weights and gradients (weight sync, export, checks).

A mixin: it reads the engine's `module`, `optimizer`, `scheduler`, `hf_root`, `device`, `tied`, `dims` and
`ep_names` (expert-parallel slices, rlsp.parallel.expert_parallel), which FSDPEngine sets up.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlsp.engine.fsdp_offload import to_device
from rlsp.models.vision_inputs import TIED_EMBED_NAMES
from rlsp.parallel.ep_state import convert_state
from rlsp.parallel.expert_parallel import expert_sharded_names, gather_full
from rlsp.parallel.tp_experts import convert_strided_state, strided_placements


class EngineState:
    # ----------------------------------------------------------------- state (checkpoints)
    def _trainable_only(self) -> set[str] | None:
        """Names of the trainable parameters when a trainable engine also holds frozen ones (LoRA
        adapters on a base), else None. Such an engine checkpoints only what training changes: the
        frozen weights are those it was built from (the model path)."""
        if self.optimizer is None:
            return None
        trainable = {n for n, p in self.module.named_parameters() if p.requires_grad}
        return trainable if len(trainable) < len(list(self.module.parameters())) else None

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and LR-schedule state; model/optimizer tensors stay sharded (DTensors)."""
        model = get_model_state_dict(self.module)
        if (trainable := self._trainable_only()) is not None:
            model = {k: v for k, v in model.items() if k in trainable}
        state: dict[str, Any] = {"model": model}
        if self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.module, self.optimizer)
            state["scheduler"] = self.scheduler.state_dict()
        if self.ep_names:  # expert slices as pieces of the whole HF tensors (rlsp.parallel.ep_state)
            convert_state(state, expert_sharded_names(self.module), self.dims.ep_save_mesh, to_whole=True)
        if strided := strided_placements(self.module):  # expert-tp gate_up_proj: contiguous pieces for DCP
            convert_strided_state(state, strided, to_checkpoint=True)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned; the optimizer keeps (does not copy) the given tensors."""
        if self.ep_names:
            convert_state(state, expert_sharded_names(self.module), self.dims.ep_replicate_mesh, to_whole=False)
        if strided := strided_placements(self.module):
            convert_strided_state(state, strided, to_checkpoint=False)
        set_model_state_dict(self.module, state["model"],
                             options=StateDictOptions(strict=self._trainable_only() is None))
        if self.optimizer is not None:
            missing = sorted({"optimizer", "scheduler"} - set(state))
            if missing:
                raise ValueError(f"state of a trainable engine lacks {missing}; it has {sorted(state)}")
            set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])

    # ----------------------------------------------------------------- weights
    def _named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.hf_root.named_parameters()

    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one parameter at a time (collective: every rank must iterate)."""
        for name, param in self._named_params():
            param = to_device(param, self.device)  # an offloaded shard is gathered on the device
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            full = gather_full(full, self.ep_names[name]) if name in self.ep_names else full
            full = full.detach().to(dtype or full.dtype)
            yield name, full
            if self.tied and name in TIED_EMBED_NAMES:  # a vision-language model's too (model.language_model.*)
                yield "lm_head.weight", full

    def iter_full_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full gradients (collective); for checks and tests."""
        for name, param in self._named_params():
            if param.grad is not None:
                g = to_device(param.grad, self.device)
                g = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach()
                yield name, gather_full(g, self.ep_names[name]) if name in self.ep_names else g
