"""What the tensor-parallel styles that run a block on plain local tensors share (rlsp.parallel.tp_families'
LocalReplicatedMoE, tp_experts, tp_latent, tp_linear_attention): the forward that routes the tp plan's DTensor call to
the style and lets torch.func.functional_call re-enter the module's own forward, and the block input whose gradient
is this rank's share.

Legend: S tokens of the sp shard fed to the decoder, h hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from rlsp.parallel.tp_sp import ShardedInputSaver


def route_dtensor_calls(module: nn.Module, run: Callable[[tuple, dict], Any]) -> None:
    """Make `module.forward` call `run(args, kwargs)` when the block input (`hidden_states`, else the first
    positional argument) is a DTensor, the tp plan's call; on plain tensors it stays the module's own forward, which
    the styles that run a block on local tensors re-enter through torch.func.functional_call."""
    plain_forward = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if not isinstance(hidden, DTensor):
            return plain_forward(*args, **kwargs)
        return run(args, kwargs)

    module.forward = forward


def partial_grad_input(hidden: DTensor, saver: ShardedInputSaver) -> torch.Tensor:
    """A block's input [1, S, h] as a plain tensor for a block run on local tensors whose every path's input gradient
    is this rank's share (rlsp.parallel.tp_latent, tp_linear_attention): declared Partial over tp and summed by the
    collective that made the full input -- the all-gather of a token-sharded residual (backward: a reduce-scatter;
    `saver` then keeps only the shard for the projections that read it), or Megatron's f on a replicated one
    (identity forward, all-reduce backward)."""
    if hidden.placements != (Replicate(),):
        full = hidden.redistribute(placements=[Replicate()])
        saver.begin(hidden, full)
    else:
        full = DTensor.from_local(hidden.to_local(), hidden.device_mesh, [Replicate()], run_check=False)
    return full.to_local(grad_placements=(Partial(),))
