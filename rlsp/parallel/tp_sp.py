"""Sequence-parallel TP blocks save their input's sequence shard for backward, not the all-gathered input.

Under tensor parallelism with sequence-parallel activations (rlsp.parallel.tensor_parallel), an
attention or MLP block all-gathers its token-sharded input [s, h] into the full [S, h] = [tp * s, h]
its column-parallel projections (q/k/v, gate/up) multiply. Autograd would keep that gathered input
alive until backward, for the projections' weight gradients: S * h per block on every tp rank, as
much as without tensor parallelism. Megatron's choice, made here: keep only this rank's shard [s, h]
and all-gather it again in backward, once per block, when the first of its projections needs it.

`ShardedInputSaver` does it with saved-tensor hooks scoped to the projections' forward calls (inside
a linear only its input and weight are saved): a tensor whose storage is the block's gathered input
is packed as a reference to the block's shard, anything else passes through unchanged. The scope is
the projection modules (`attach`), or a region of code (`scope`) for a block that multiplies slices
of a weight with F.linear; the saved tensor is a DTensor (the DTensor blocks) or a plain view of the
gathered input's local tensor (the blocks that run on local tensors: rlsp.parallel.tp_latent,
rlsp.parallel.tp_linear_attention), restored as such. Backward unpacks the first reference by
all-gathering the shard (the same bytes the forward gathered: the gradients are bit-identical),
serves the block's other projections from that copy and drops it after the last one. The gradient
of the gathered input is still reduce-scattered by the all-gather's own backward (DTensor's
redistribute), so nothing else changes. `enabled = False` keeps autograd's own saving (a reference
for measurements).

The hooks compose with any pair active around the block (activation offload, gradient checkpointing's
recomputation, a measuring hook): tensors passed through go to that outer pair, and the shard goes to
it once per block call (an offloaded shard travels to host memory instead of the gathered input; under
checkpointing the recomputation re-gathers, then backward gathers again: one extra all-gather per
block, the price of never holding [S, h]). Where saved-tensor hooks are disabled (tracing) the block
saves the gathered input as before.

Legend: s tokens of this tp rank, S = tp * s tokens of the tp group, h hidden size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# torch >= 2.13 names the single-tensor all-gather all_gather_single (the older name warns there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_Hooks = tuple[Any, Any]  # (pack, unpack) of an outer saved-tensor hook pair


@dataclass
class _Gathered:
    """One block call: its input shard, where the gathered input lives, and backward's re-gathered copy."""

    shard_sh: DTensor  # [1, s, h], Shard(1): this rank's tokens (detached: the reference holds no graph)
    storage: int  # data_ptr of the gathered input's storage in forward
    offset: int  # the gathered local tensor's storage offset (views are rebased on the new copy)
    group: dist.ProcessGroup
    outer: _Hooks | None = None
    packed_shard: Any = None  # the shard as the outer pack stored it (or the shard itself)
    packs: int = 0  # references handed to autograd
    unpacks: int = 0
    full_Sh: torch.Tensor | None = field(default=None, repr=False)  # backward's gathered copy, while needed


@dataclass(frozen=True)
class _Regather:
    """What autograd stores for a view of the gathered input: its block and the view's geometry."""

    block: _Gathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    layout: tuple[Any, ...] | None  # (mesh, placements, global shape, global stride) of a saved DTensor; None: plain


@dataclass(frozen=True)
class _Outer:
    packed: Any  # what the outer pack hook returned for a tensor that is not the gathered input


def _regather(block: _Gathered) -> torch.Tensor:
    """The gathered input's local tensor [1, S, h], from the (outer-unpacked) shard."""
    shard = block.outer[1](block.packed_shard) if block.outer is not None else block.packed_shard
    local = (shard.to_local() if isinstance(shard, DTensor) else shard).contiguous()
    size = dist.get_world_size(block.group)
    out = torch.empty((size, *local.shape[1:]), dtype=local.dtype, device=local.device)
    _all_gather(out, local, group=block.group)  # the tp ranks' contiguous token blocks, in rank order
    return out.view(1, size * local.shape[1], *local.shape[2:])


class ShardedInputSaver:
    """Attach to one column-parallel block: `begin` when the block has gathered its input, `end` after
    its forward, `attach` each projection that reads the gathered input, or run the code that reads it
    within `scope()` (see the module docstring)."""

    def __init__(self) -> None:
        self.current: _Gathered | None = None
        self.regathers = 0  # all-gathers backward has run (one per block call, or per re-run)
        self._pushed: list[bool] = []  # per projection call: whether hooks were pushed (LIFO)
        self.enabled = True  # False: autograd keeps the gathered input (a reference for measurements)

    def begin(self, shard: DTensor, full: DTensor) -> None:
        local = full.to_local()
        even = shard.to_local().shape[1] * full.device_mesh.size() == local.shape[1]
        if not (self.enabled and local.is_contiguous() and even):
            self.current = None  # disabled, or an unexpected layout: keep autograd's own saving
            return
        self.current = _Gathered(shard.detach(), local.untyped_storage().data_ptr(), local.storage_offset(),
                                 full.device_mesh.get_group())

    def end(self, *_: Any) -> None:
        self.current = None

    def attach(self, projection: nn.Module) -> None:
        projection.register_forward_pre_hook(self._enter)
        projection.register_forward_hook(self._exit, always_call=True)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The hooks around a region of code, as around an attached projection's forward call."""
        self._enter(None, ())
        try:
            yield
        finally:
            self._exit()

    def _enter(self, module: nn.Module | None, args: Any) -> None:
        push = self.current is not None and torch._C._autograd._saved_tensors_hooks_is_enabled()
        if push:
            # the public saved_tensors_hooks context would hide an outer pair (only the innermost pair
            # runs); reading the top of autograd's hook stack lets this pair delegate to it instead
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            block = self.current
            torch._C._autograd._push_saved_tensors_default_hooks(
                lambda t: self._pack(block, outer, t), lambda p: self._unpack(outer, p))
        self._pushed.append(push)

    def _exit(self, *_: Any) -> None:
        if self._pushed.pop():
            torch._C._autograd._pop_saved_tensors_default_hooks()

    @staticmethod
    def _pack(block: _Gathered, outer: _Hooks | None, t: torch.Tensor) -> Any:
        dtensor = isinstance(t, DTensor)
        local = t._local_tensor if dtensor else t
        if not (dtensor or type(t) is torch.Tensor) or local.untyped_storage().data_ptr() != block.storage:
            return _Outer(outer[0](t)) if outer is not None else t
        if block.packs == 0:  # the shard goes to the outer pair once per block call
            block.outer = outer
            block.packed_shard = outer[0](block.shard_sh) if outer is not None else block.shard_sh
        block.packs += 1
        layout = (t.device_mesh, t.placements, t.shape, t.stride()) if dtensor else None
        return _Regather(block, tuple(local.size()), tuple(local.stride()), local.storage_offset() - block.offset, layout)

    def _unpack(self, outer: _Hooks | None, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Outer):
            return outer[1](packed.packed)
        if not isinstance(packed, _Regather):
            return packed
        block = packed.block
        full = block.full_Sh
        if full is None:
            full = _regather(block)
            self.regathers += 1
        block.unpacks += 1
        # keep the copy for the block's other projections; the last one (or a re-run) lets it go
        block.full_Sh = full if block.unpacks < block.packs else None
        local = full.as_strided(packed.size, packed.stride, full.storage_offset() + packed.offset)
        if packed.layout is None:  # a plain view of the gathered local tensor
            return local
        mesh, placements, shape, stride = packed.layout
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

