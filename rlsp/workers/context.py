"""What every role on a worker shares: the run config and what it resolves to (the run spec), this rank, the device
and the parallel layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
from omegaconf import DictConfig

from rlsp.config.layout import ParallelLayout, RoleLayout
from rlsp.config.run_spec import RunSpec, resolve_run_spec
from rlsp.parallel.mesh import ParallelDims, build_parallel_dims


def group_timeout(cfg: DictConfig) -> timedelta:
    """The timeout of every process group of the run's workers: verl's actor_rollout_ref.nccl_timeout (seconds)."""
    return timedelta(seconds=int(cfg.actor_rollout_ref.nccl_timeout))


@dataclass
class RoleContext:
    cfg: DictConfig
    rank: int
    layout: ParallelLayout  # the run's layout, computed once by validate_config in the driver
    device: torch.device
    pad_token_id: int
    _dims: dict[RoleLayout, ParallelDims] = field(default_factory=dict, repr=False)
    spec: RunSpec = field(init=False)  # what the checked config resolves to, once per worker

    def __post_init__(self) -> None:
        self.spec = resolve_run_spec(self.cfg)

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def prompt_len(self) -> int:
        return int(self.cfg.data.max_prompt_length)

    def dims(self, role: str) -> ParallelDims:
        """The meshes of `role`'s layout (built once per distinct layout; collective on first use)."""
        layout = self.layout.role(role)
        if layout not in self._dims:
            self._dims[layout] = build_parallel_dims(layout, self.device_type, group_timeout(self.cfg))
        return self._dims[layout]
