"""Parallel dims of the training world: a (dp, sp) device mesh; FSDP2 shards over all ranks.

Rank layout is row-major over (dp, sp): rank = dp_rank * sp_size + sp_rank, so the ranks of one sp
group are neighbours (on a GPU node they share the fast interconnect).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    world_size: int
    sp_size: int
    rank: int
    mesh: DeviceMesh  # 2-D (dp, sp)
    fsdp_mesh: DeviceMesh  # 1-D over the whole world (FSDP), or 2-D (replicate, shard) for HSDP
    dp_group: dist.ProcessGroup
    sp_group: dist.ProcessGroup

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size


def build_parallel_dims(sp_size: int, device_type: str, fsdp_size: int = -1) -> ParallelDims:
    """Build the mesh over the already-initialised default process group.

    `fsdp_size` -1 (or the world size) shards parameters over every rank; a divisor of the world
    gives a 2-D (replicate, shard) mesh: FSDP2 then shards within groups of `fsdp_size` consecutive
    ranks and replicates across them (HSDP), reducing gradients over both dimensions.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    legal = [d for d in range(1, world + 1) if world % d == 0]
    if sp_size < 1 or world % sp_size != 0:
        raise ValueError(f"sp_size={sp_size} does not divide world_size={world}; legal values: {legal}")
    if fsdp_size != -1 and fsdp_size not in legal:
        raise ValueError(f"fsdp_size={fsdp_size} does not divide world_size={world}; legal values: -1 or {legal}")
    mesh = init_device_mesh(device_type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    if fsdp_size in (-1, world):
        fsdp_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    else:
        fsdp_mesh = init_device_mesh(device_type, (world // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard"))
    return ParallelDims(
        world_size=world,
        sp_size=sp_size,
        rank=rank,
        mesh=mesh,
        fsdp_mesh=fsdp_mesh,
        dp_group=mesh["dp"].get_group(),
        sp_group=mesh["sp"].get_group(),
    )
