"""Activation offload: the tensors a micro-batch's forward saves for backward wait in host memory.

With gradient checkpointing on, what the forward saves is mostly each decoder layer's input (the
checkpoint's one saved tensor per layer, [S, H]) plus the few tensors outside the layers (final norm,
logprob head); everything inside a layer is recomputed in backward. `ActivationOffload` is the
context manager the engine enters around the forward (and loss) of every training micro-batch: a
pair of saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, the mechanism behind
`torch.autograd.graph.save_on_cpu`) copies each saved tensor that lives on the device into (pinned,
on CUDA) host memory when autograd saves it, and copies it back when backward unpacks it. Device
memory for saved activations drops from L x [S, H] to nothing between forward and backward, at the
price of two PCIe copies of those bytes per micro-batch (not overlapped with compute: the copies
run on the compute stream; a prefetching side stream is future work).

Unlike `save_on_cpu` the hooks leave parameters alone: a saved tensor that shares storage with one
of the model's parameters (FSDP's unsharded weights, the output layer the logprob head saves, a
tensor-parallel local view of a weight) is kept as it is, since it lives on the device anyway.
Backward runs outside the hooks on purpose: the recomputations there (checkpointed layers, tiled
MLP) save tensors that are used right away and must not make a round trip through host memory.

On a CPU run every tensor already lives in host memory: the option is accepted, has no effect and
says so once in the log. `offload_saved_tensors(model, device)` is the hook pair itself; it works for
any device (on CPU it copies into fresh host buffers, which is how the tests exercise it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlsp.utils.device import same_device
from rlsp.utils.logging import get_logger

log = get_logger(__name__)


@dataclass
class OffloadStats:
    """What the hooks did in the last forward they ran in."""

    tensors: int = 0  # saved tensors copied to host memory
    bytes: int = 0
    kept: int = 0  # saved tensors left where they were (parameters, tensors on another device)


def _param_storages(model: nn.Module) -> set[int]:
    """Storage addresses of the model's parameters as they are now (FSDP swaps unsharded ones in)."""
    out = set()
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        out.add(local.untyped_storage().data_ptr())
    return out


@contextlib.contextmanager
def offload_saved_tensors(model: nn.Module, device: torch.device, stats: OffloadStats | None = None) -> Iterator[OffloadStats]:
    """Saved tensors on `device` that are not (views of) `model`'s parameters go to host memory
    while this context is active, pinned when `device` is CUDA; backward brings them back. `device`
    may name no index (`cuda` matches tensors on the current CUDA device)."""
    stats = stats if stats is not None else OffloadStats()
    stats.tensors = stats.bytes = stats.kept = 0
    pin = device.type == "cuda"

    def pack(t: torch.Tensor) -> torch.Tensor | tuple[torch.device, torch.Tensor]:
        if (not same_device(t.device, device) or t.numel() == 0 or isinstance(t, nn.Parameter)
                or t.untyped_storage().data_ptr() in _param_storages(model)):
            stats.kept += 1
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        stats.tensors += 1
        stats.bytes += t.numel() * t.element_size()
        return (t.device, host)

    def unpack(packed: torch.Tensor | tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        where, host = packed
        return host.to(where, non_blocking=pin)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield stats


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
