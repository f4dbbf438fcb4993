"""What every role on a worker shares: the run config, this rank, the device and the parallel layout."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from rlsp.config.layout import MeshLayout
from rlsp.parallel.mesh import ParallelDims, build_parallel_dims


@dataclass
class RoleContext:
    cfg: DictConfig
    rank: int
    mesh_layout: MeshLayout  # the world this worker belongs to (its sp size is the policy's or the critic's)
    device: torch.device
    pad_token_id: int
    _dims: dict[tuple[int, int], ParallelDims] = field(default_factory=dict, repr=False)

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def prompt_len(self) -> int:
        return int(self.cfg.data.max_prompt_length)

    def dims(self, sp_size: int, fsdp_size: int = -1) -> ParallelDims:
        """The (dp, sp) mesh of this world for `sp_size` and the parameter-sharding mesh for `fsdp_size`
        (built once per pair; collective on first use)."""
        key = (sp_size, fsdp_size)
        if key not in self._dims:
            if self.mesh_layout.world_size % sp_size:
                raise ValueError(f"sp_size={sp_size} does not divide the world of {self.mesh_layout.world_size} ranks")
            self._dims[key] = build_parallel_dims(sp_size, self.device_type, fsdp_size)
        return self._dims[key]
