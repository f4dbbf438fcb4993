"""An unsharded view of a head model for the start-up self-check under tensor parallelism.

With tp > 1 the engine's module holds only its tp rank's share of every layer, so "the same forward
without sharding" cannot run on it. Before tensor parallelism is applied the engine keeps a skeleton:
a copy of the head model whose parameters live on the meta device (no memory; buffers such as rotary
frequencies are real copies). The self-check runs the skeleton with the gathered full weights
substituted by name (`torch.func.functional_call`), on an unsharded micro-batch. That holds one full
copy of the weights per rank while it runs; set trainer.sp_self_check=false where that does not fit.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters are meta tensors (same names, shapes and tying)."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                            for p in module.parameters()}
    return copy.deepcopy(module, memo)


def run_skeleton(skeleton: nn.Module, params: dict[str, torch.Tensor], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
    """`skeleton(*args, **kwargs)` with `params` (full tensors, names relative to the skeleton) in place
    of its meta parameters; every parameter must be given."""
    missing = sorted({name for name, _ in skeleton.named_parameters()} - set(params))
    if missing:
        raise RuntimeError(f"unsharded reference lacks {len(missing)} parameters, e.g. {missing[:3]}")
    return torch.func.functional_call(skeleton, params, args, kwargs)
