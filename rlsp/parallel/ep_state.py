"""Checkpoint views of expert-parallel parameters: each rank's expert slice shown as a piece of the whole tensor.

Under expert parallelism (rlsp.parallel.expert_parallel) an experts tensor of a rank is a DTensor over the ranks
holding the same experts (`ep_replicate`) whose global shape is only this rank's E/ep experts: saved as is, every
expert-parallel rank would write a different tensor under the same name. `to_global` re-describes the same local
shard (no copy) as a DTensor of the whole [E, ...] tensor over a (ep, ep_replicate) mesh, placements
(Shard(0), Shard(0)): the experts split over ep first, each slice over its replicas as FSDP2 splits it, so
torch.distributed.checkpoint writes and reads every piece at its place in the HF tensor, reshards it onto any
other layout (ep 1, another world) and an offline load sees whole tensors. `to_local` turns such a view back
into the parameter's own DTensor for `set_model_state_dict` / `set_optimizer_state_dict`. Both walk a model or
optimizer state dict and convert only the entries of expert-sliced parameters (`names`: FQN -> ExpertShard).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from rlsp.parallel.expert_parallel import ExpertShard


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for size in reversed(shape):
        out.append(acc)
        acc *= size
    return tuple(reversed(out))


def _view(local: torch.Tensor, mesh: DeviceMesh, placements: list, shape: tuple[int, ...]) -> DTensor:
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=_stride(shape))


def _convert(value: Any, shard: ExpertShard, mesh: DeviceMesh, to_whole: bool) -> Any:
    if not isinstance(value, DTensor) or value.dim() == 0:
        return value
    rest = tuple(value.shape[1:])
    if to_whole:
        return _view(value.to_local(), mesh, [Shard(0), Shard(0)], (shard.num_experts, *rest))
    return _view(value.to_local(), mesh, [Shard(0)], (shard.local, *rest))


def convert_state(state: dict[str, Any], names: dict[str, ExpertShard], mesh: DeviceMesh, to_whole: bool) -> None:
    """In place: the model entries {fqn: tensor} and optimizer entries {"state": {fqn: {key: tensor}}} of expert-
    sliced parameters, as whole-tensor views over the 2-D `mesh` (`to_whole`) or back over the 1-D replica `mesh`."""
    model = state.get("model", {})
    for fqn in [k for k in model if k in names]:
        model[fqn] = _convert(model[fqn], names[fqn], mesh, to_whole)
    optim_state = state.get("optimizer", {}).get("state", {})
    for fqn in [k for k in optim_state if k in names]:
        optim_state[fqn] = {k: _convert(v, names[fqn], mesh, to_whole) for k, v in optim_state[fqn].items()}
