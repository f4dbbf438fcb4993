"""Tensor parallelism for Gated DeltaNet (linear attention) layers: Qwen3-Next, Qwen3.5, Qwen3.5-MoE.

`GroupShardedGatedDeltaNet` is the tp plan entry of a decoder layer's `linear_attn` (rlsp.models.linear_attention's
`UlyssesGatedDeltaNet`, swapped in at load). The layer is split over tp by key-head groups (a group: one key head
and the r value heads that read it; linear_num_key_heads must divide by tp): tp rank t owns groups
[t*G/tp, (t+1)*G/tp) and computes their q, k, v, z, b, a, conv and delta rule over the whole token range of its sp
shard, and Ulysses then splits those groups further over sp as without tp. Parameters:
  - per-group / per-value-head projections, contiguous per rank, Shard(0): Qwen3-Next's in_proj_qkvz and
    in_proj_ba (laid out group by group), Qwen3.5's in_proj_z, in_proj_b, in_proj_a (value head by value head);
  - out_proj row-parallel, Shard(1): its input is the value heads in order; the ranks' partial outputs are summed
    over tp (an all-reduce, or a reduce-scatter to the rank's tokens under sequence parallelism);
  - Qwen3.5's in_proj_qkv ([q all heads | k all heads | v all heads]: a rank's rows are three separate blocks, not
    one Shard) and the small conv1d weight ([q | k | v] channels likewise), A_log, dt_bias (per value head) and the
    gated norm's weight (one for all heads): replicated, each rank reading its rows only.
A sharded weight's local gradient covers every token of the shard: complete (its placement). A replicated weight's
local gradient holds this rank's rows (the norm weight: its heads' share), zero elsewhere: Partial over tp, summed
by FSDP2 before its dp reduction (or `reduce_tp_replicated_grads`), as for HeadShardedNorm.
Input: the residual stream gathered to the full token range (sequence parallel: an all-gather, whose backward
reduce-scatters; otherwise Megatron's f operator, identity forward and all-reduce backward); the input's local
gradient is this rank's groups' share: Partial. The block runs on plain local tensors (its packed-segment kernels
and all-to-alls have no DTensor rules), as LocalReplicatedMoE does. Exact against one process
(tests/distributed/test_tp_linear_exact.py). Not split: the memory of Qwen3.5's in_proj_qkv (making a rank's rows
contiguous would permute the checkpoint's layout, which weight sync and export keep; the planner counts it whole:
rlsp.plan.memory.tp_replicated). Under sequence parallelism the in_proj_* projections (the module's `_project`,
which multiplies weight rows with F.linear) save only this rank's [S/tp, H] shard of the gathered input for their
weight gradients, all-gathered again once per block call in backward, as the attention and MLP blocks do
(rlsp.parallel.tp_sp; the block's `tp_input_saver`).

Legend: S tokens of the sp shard fed to the decoder, H hidden size, G key-head groups (linear_num_key_heads).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from rlsp.parallel.tp_families import SEQ_DIM, replicate_params
from rlsp.parallel.tp_local import partial_grad_input, route_dtensor_calls
from rlsp.parallel.tp_sp import ShardedInputSaver

# weight name -> the dim tp shards (contiguous per rank); every other parameter is replicated (rows read per rank)
SHARDED_WEIGHTS = {"in_proj_qkvz.weight": 0, "in_proj_ba.weight": 0, "in_proj_z.weight": 0, "in_proj_b.weight": 0,
                   "in_proj_a.weight": 0, "out_proj.weight": 1}
_LINEARS = ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def check_groups(num_groups: Any, tp_size: int) -> None:
    """Raise ValueError unless tp_size splits the key-head groups evenly."""
    if not isinstance(num_groups, int) or num_groups < 1 or num_groups % tp_size:
        legal = [d for d in range(1, num_groups + 1) if num_groups % d == 0] if isinstance(num_groups, int) else []
        raise ValueError(f"linear_num_key_heads={num_groups!r} is not a multiple of tensor_model_parallel_size="
                         f"{tp_size} (the Gated DeltaNet layers split over tp by key-head groups); legal "
                         f"tensor_model_parallel_size for them: {', '.join(map(str, legal))}")


def _check_module(module: nn.Module) -> None:
    """Refuse a module that is not rlsp's Gated DeltaNet, or one with projection biases (a row-parallel partial sum
    would repeat out_proj's; the projections of the supported families have none)."""
    if not (hasattr(module, "groups") and hasattr(module, "num_k_heads") and hasattr(module, "out_proj")):
        raise ValueError(f"{type(module).__name__} is not rlsp's UlyssesGatedDeltaNet (rlsp.models.linear_attention, "
                         "swapped in at load); tensor parallelism splits only that form of a linear_attn layer")
    biased = [n for n in _LINEARS if getattr(getattr(module, n, None), "bias", None) is not None]
    if biased:
        raise ValueError(f"{type(module).__name__} has biases on {biased}; rlsp's tensor parallelism of Gated "
                         "DeltaNet layers supports projections without bias (Qwen3-Next, Qwen3.5)")


def _save_shard_only(module: nn.Module) -> None:
    """Run the module's input projections (`_project`: F.linear on weight rows, which module hooks would not see)
    within a `ShardedInputSaver` scope; `tp_input_saver` is begun and ended around each block call."""
    saver, project = ShardedInputSaver(), module._project
    module.tp_input_saver = saver  # inspectable (how often backward re-gathered)

    def scoped_project(h_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with saver.scope():
            return project(h_SH)

    module._project = scoped_project


class GroupShardedGatedDeltaNet(ParallelStyle):
    """A `linear_attn` block split over tp by key-head groups (see the module docstring); `seq`: the residual
    stream's layout (Shard(SEQ_DIM) under sequence parallelism, else Replicate). Returns a DTensor in `seq`."""

    def __init__(self, seq: Placement) -> None:
        super().__init__()
        self.seq = seq

    def _distribute(self, module: nn.Module, mesh: DeviceMesh) -> None:
        for name, dim in SHARDED_WEIGHTS.items():
            owner_name, _, attr = name.rpartition(".")
            owner = getattr(module, owner_name, None)
            if owner is not None:
                param = getattr(owner, attr)
                sharded = distribute_tensor(param.data, mesh, [Shard(dim)])
                owner.register_parameter(attr, nn.Parameter(sharded, requires_grad=param.requires_grad))
        for sub in module.modules():
            replicate_params(sub, mesh)  # the rest (already sharded DTensors are left as they are)

    def _run(self, module: nn.Module, args: tuple, kwargs: dict) -> DTensor:
        if "hidden_states" in kwargs:  # transformers' decoder layers pass it by keyword
            hidden = kwargs.pop("hidden_states")
        else:
            hidden, args = args[0], args[1:]
        mesh = hidden.device_mesh
        x = partial_grad_input(hidden, module.tp_input_saver)  # the projections save the shard (module docstring)
        local = {n: p.to_local(grad_placements=None if any(pl.is_shard() for pl in p.placements) else (Partial(),))
                 for n, p in module.named_parameters()}
        try:
            out = torch.func.functional_call(module, local, args, {**kwargs, "hidden_states": x})
        finally:
            module.tp_input_saver.end()
        partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return partial.redistribute(placements=[self.seq])  # all-reduce, or reduce-scatter to this rank's tokens

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_module(module)
        tp, rank, groups = device_mesh.size(), device_mesh.get_local_rank(), module.num_k_heads
        check_groups(groups, tp)
        if self.seq.is_shard() and self.seq.dim != SEQ_DIM:
            raise ValueError(f"the residual stream is sharded on dim {self.seq.dim}; expected the tokens, {SEQ_DIM}")
        self._distribute(module, device_mesh)
        module.groups = (rank * groups // tp, (rank + 1) * groups // tp)
        _save_shard_only(module)
        route_dtensor_calls(module, lambda args, kwargs: self._run(module, args, dict(kwargs)))
        return module
