"""Activation offload: the tensors a micro-batch's forward saves for backward wait in host memory.

With gradient checkpointing on, what the forward saves is mostly each decoder layer's input (the
checkpoint's one saved tensor per layer, [S, H]) plus the few tensors outside the layers (final norm,
logprob head); everything inside a layer is recomputed in backward. `ActivationOffload` is the
context manager the engine enters around the forward (and loss) of every training micro-batch: a
pair of saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, the mechanism behind
`torch.autograd.graph.save_on_cpu`) copies each saved tensor that lives on the device into (pinned,
on CUDA) host memory when autograd saves it, and copies it back for backward.

The copies overlap with compute (rlsp.engine.offload_queue): on CUDA the device -> host copies run
on a side stream, and in backward the tensors of the next checkpointed layer backward will reach
(the one before in forward order) are copied back on another side stream while the current layer
is recomputed and differentiated. Device memory for saved activations drops from L x [S, H] to two
layers' inputs at most (the one in use, the one prefetched), at the price of two PCIe transfers of
those bytes per micro-batch, hidden behind compute when a layer's backward outlasts one transfer.
Layers are told apart by a forward pre-hook on each checkpointed decoder layer
(`GradientCheckpointingLayer`); a model without such layers prefetches one saved tensor ahead.

Unlike `save_on_cpu` the hooks leave parameters alone: a saved tensor that shares storage with one
of the model's parameters (FSDP's unsharded weights, the output layer the logprob head saves, a
tensor-parallel local view of a weight) is kept as it is, since it lives on the device anyway. A
DTensor (tensor parallelism) travels as its local tensor and is rewrapped with its layout.
Backward runs outside the hooks on purpose: the recomputations there (checkpointed layers, tiled
MLP) save tensors that are used right away and must not make a round trip through host memory.

On a CPU run every tensor already lives in host memory: the option is accepted, has no effect and
says so once in the log. `offload_saved_tensors(model, device)` is the hook pair itself; it works for
any device (on CPU it copies into fresh host buffers, on the same schedule, which is how the tests
exercise it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.modeling_layers import GradientCheckpointingLayer

from rlsp.engine.offload_queue import CudaCopies, HostCopies, OffloadQueue, OffloadStats
from rlsp.utils.device import same_device
from rlsp.utils.logging import get_logger

__all__ = ["ActivationOffload", "OffloadStats", "offload_saved_tensors"]

log = get_logger(__name__)


def _param_storages(model: nn.Module) -> set[int]:
    """Storage addresses of the model's parameters as they are now (FSDP swaps unsharded ones in)."""
    out = set()
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        out.add(local.untyped_storage().data_ptr())
    return out


def _layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _unpack(packed: Any) -> torch.Tensor:
    """A kept tensor as it is; an offloaded one from its queue (a DTensor rewrapped with its layout)."""
    if isinstance(packed, torch.Tensor):
        return packed
    queue, index, layout = packed
    local = queue.take(index)
    if layout is None:
        return local
    mesh, placements, shape, stride = layout
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


@contextlib.contextmanager
def offload_saved_tensors(model: nn.Module, device: torch.device, stats: OffloadStats | None = None,
                          log: list[tuple[str, int]] | None = None) -> Iterator[OffloadStats]:
    """Saved tensors on `device` that are not (views of) `model`'s parameters go to host memory
    while this context is active, pinned when `device` is CUDA; backward brings them back one layer
    ahead (see the module docstring). `device` may name no index (`cuda` matches tensors on the
    current CUDA device). `log` (tests) receives the queue's events."""
    stats = stats if stats is not None else OffloadStats()
    stats.reset()
    queue = OffloadQueue(CudaCopies(device) if device.type == "cuda" else HostCopies(), stats, log)
    layers = _layers(model)
    if not layers:  # no layer boundaries: every saved tensor is a group of its own (prefetch one ahead)
        queue.group = -1

    handles = [layer.register_forward_pre_hook(lambda module, args: queue.new_group()) for layer in layers]

    def pack(t: torch.Tensor) -> Any:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if (not same_device(local.device, device) or local.numel() == 0 or isinstance(t, nn.Parameter)
                or local.untyped_storage().data_ptr() in _param_storages(model)):
            stats.kept += 1
            return t
        if not layers:
            queue.new_group()
        layout = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return (queue, queue.put(local), layout)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield stats
    finally:
        for handle in handles:
            handle.remove()


class ActivationOffload:
    """`with offload():` around a training forward; a no-op unless enabled on an accelerator."""

    def __init__(self, enabled: bool, model: nn.Module, device: torch.device) -> None:
        self.enabled, self.model, self.device = enabled, model, device
        self.stats = OffloadStats()
        if enabled and device.type == "cpu":
            log.info("activation offload (enable_activation_offload=true) has no effect on cpu: saved "
                     "activations already live in host memory")

    @property
    def active(self) -> bool:
        return self.enabled and self.device.type != "cpu"

    def __call__(self) -> contextlib.AbstractContextManager:
        if not self.active:
            return contextlib.nullcontext(self.stats)
        return offload_saved_tensors(self.model, self.device, self.stats)
