"""The torch side of a role's layout: device meshes and process groups for every degree.

`build_parallel_dims(layout, device_type)` turns a `RoleLayout` (plain arithmetic, rlsp.config) into
the meshes the engine needs; nothing here re-derives a degree from the config. Rank order is the
layout's: (dp, ring, ulysses, tp), tp innermost.

- `mesh` (dp, ring, ulysses, tp) gives the groups: `ulysses_group` (head all-to-all), `ring_group`
  (K/V passing), `tp_group`, and `dp_group` (ranks holding different rows, for global token counts);
- `ring_dkv_group`: a second group over the ring group's ranks, for ring attention's dK/dV
  accumulators in backward (their own NCCL communicator: see rlsp/parallel/ring.py);
- `fsdp_mesh` is what FSDP2 shards parameters over: every rank but the tp dimension (1-D), or
  (replicate, shard) for HSDP; with tp > 1 it and `tp_mesh` are sub-meshes of one (replicate,
  shard, tp) mesh, as FSDP2 over tensor-parallel parameters requires;
- `ep_mesh` (ep > 1, tp 1): (ep_replicate, ep) over the same ranks: `ep_group` (runs of ep consecutive
  ranks, whose all-to-alls dispatch tokens to their experts) and `ep_replicate` (the ranks holding the
  same experts, which FSDP2 shards those experts over); see rlsp.parallel.expert_parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlsp.config.layout import Coords, RoleLayout


@dataclass
class ParallelDims:
    layout: RoleLayout
    rank: int
    mesh: DeviceMesh  # (dp, ring, ulysses, tp)
    fsdp_mesh: DeviceMesh
    tp_mesh: DeviceMesh | None  # None when tp == 1
    # adaptive Ulysses: degree -> this rank's group of that many consecutive Ulysses ranks (1 < d < ulysses)
    ulysses_subgroups: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    ring_dkv_group: dist.ProcessGroup | None = None  # the ring's ranks again (ring > 1): dK/dV accumulators
    ep_mesh: DeviceMesh | None = None  # (ep_replicate, ep) when ep > 1
    ep_save_mesh: DeviceMesh | None = None  # the same ranks as (ep, ep_replicate): whole expert tensors in checkpoints

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    def _group(self, name: str, size: int) -> dist.ProcessGroup | None:
        return self.mesh[name].get_group() if size > 1 else None

    @property
    def ulysses_group(self) -> dist.ProcessGroup | None:
        """None when ulysses == 1 (no all-to-all)."""
        return self._group("ulysses", self.layout.ulysses)

    def ulysses_group_of(self, degree: int) -> dist.ProcessGroup | None:
        """This rank's Ulysses group at `degree` (the full group, a sub-group when adaptive, None at 1)."""
        if degree == self.layout.ulysses:
            return self.ulysses_group
        if degree == 1:
            return None
        if degree not in self.ulysses_subgroups:
            raise ValueError(f"no Ulysses sub-group of degree {degree}; legal degrees: {self.layout.ulysses_degrees}")
        return self.ulysses_subgroups[degree]

    @property
    def ring_group(self) -> dist.ProcessGroup | None:
        return self._group("ring", self.layout.ring)

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self._group("tp", self.layout.tp)

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group (ep consecutive ranks); None when ep == 1."""
        return self.ep_mesh["ep"].get_group() if self.ep_mesh is not None else None

    @property
    def ep_replicate_mesh(self) -> DeviceMesh | None:
        """The ranks holding the same experts as this one (FSDP2 shards them there); None when ep == 1."""
        return self.ep_mesh["ep_replicate"] if self.ep_mesh is not None else None


def _param_meshes(layout: RoleLayout, device_type: str) -> tuple[DeviceMesh, DeviceMesh | None]:
    shard = layout.fsdp_shard
    replicate = layout.fsdp_ranks // shard
    if layout.tp == 1:
        if replicate == 1:
            return init_device_mesh(device_type, (shard,), mesh_dim_names=("fsdp",)), None
        return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard")), None
    root = init_device_mesh(device_type, (replicate, shard, layout.tp), mesh_dim_names=("replicate", "shard", "tp"))
    fsdp = root["shard"] if replicate == 1 else root["replicate", "shard"]
    return fsdp, root["tp"]


def _ulysses_subgroups(layout: RoleLayout, rank: int) -> dict[int, dist.ProcessGroup]:
    """Groups of d consecutive ranks of every Ulysses group, for each degree 1 < d < ulysses (collective:
    every rank creates every group, in the same order)."""
    mine: dict[int, dist.ProcessGroup] = {}
    starts = range(0, layout.world_size, layout.ulysses)  # ring == tp == 1 when adaptive
    for d in layout.ulysses_degrees[1:-1]:
        for start in starts:
            for first in range(start, start + layout.ulysses, d):
                group = dist.new_group(list(range(first, first + d)))
                if first <= rank < first + d:
                    mine[d] = group
    return mine


def _ring_dkv_group(mesh: DeviceMesh, rank: int) -> dist.ProcessGroup | None:
    """A second group over this rank's ring group (collective: every rank creates every ring's copy, in
    mesh order), so ring attention's dK/dV accumulators get a communicator of their own."""
    if mesh["ring"].size() == 1:
        return None
    mine = None
    rings = mesh.mesh.movedim(1, -1).reshape(-1, mesh["ring"].size())  # (dp, ulysses, tp) x ring
    for ranks in rings.tolist():
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def apply_group_timeout(dims: ParallelDims, timeout: timedelta) -> None:
    """Give every group of `dims` `timeout` (gloo and nccl alike): torch creates a mesh's and `new_group`'s groups
    with its backend default (30 min gloo, 10 min nccl), not the default group's timeout."""
    groups = [*dims.mesh.get_all_groups(), *dims.fsdp_mesh.get_all_groups(), *dims.ulysses_subgroups.values()]
    groups += [*(dims.tp_mesh.get_all_groups() if dims.tp_mesh is not None else []),
               *(dims.ep_mesh.get_all_groups() if dims.ep_mesh is not None else []),
               *(dims.ep_save_mesh.get_all_groups() if dims.ep_save_mesh is not None else []),
               *([dims.ring_dkv_group] if dims.ring_dkv_group is not None else [])]
    for group in groups:
        if any(name in dist.get_backend(group) for name in ("gloo", "nccl")):  # torch's fake backend has no timeout
            group.set_timeout(timeout)


def build_parallel_dims(layout: RoleLayout, device_type: str, timeout: timedelta | None = None) -> ParallelDims:
    """Build the meshes of `layout` over the already-initialised default process group (collective); `timeout`:
    every group's (None: torch's defaults)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(f"the process group has {world} ranks but the layout describes {layout.world_size} "
                         f"({layout.describe()})")
    shape = (layout.dp_size, layout.ring, layout.ulysses, layout.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "ring", "ulysses", "tp"))
    fsdp_mesh, tp_mesh = _param_meshes(layout, device_type)
    subgroups = _ulysses_subgroups(layout, rank) if layout.adaptive else {}
    ep_mesh = None
    if layout.ep > 1:  # tp == 1 (as validation requires): the FSDP ranks are the whole world, in rank order
        if layout.tp > 1 or layout.world_size % layout.ep:
            raise ValueError(f"ep={layout.ep} needs tp=1 (got {layout.tp}) and must divide the {layout.world_size} "
                             f"ranks ({layout.describe()})")
        ep_mesh = init_device_mesh(device_type, (layout.ep_replicas, layout.ep), mesh_dim_names=("ep_replicate", "ep"))
    save_mesh = None if ep_mesh is None else DeviceMesh(device_type, ep_mesh.mesh.T.contiguous(),
                                                         mesh_dim_names=("ep", "ep_replicate"))
    dims = ParallelDims(layout=layout, rank=rank, mesh=mesh, fsdp_mesh=fsdp_mesh, tp_mesh=tp_mesh,
                        ulysses_subgroups=subgroups, ring_dkv_group=_ring_dkv_group(mesh, rank), ep_mesh=ep_mesh,
                        ep_save_mesh=save_mesh)
    if timeout is not None:
        apply_group_timeout(dims, timeout)
    return dims
