"""The copy schedule behind activation offload: saved tensors out to host memory, back one layer ahead.

`OffloadQueue` holds, in forward order, the host copies of the tensors a forward saved, each tagged
with the group (checkpointed decoder layer) it was saved in. Backward unpacks the groups in reverse
order; when it first takes a tensor of group g, the queue starts copying group g - 1 back to the
device, so that copy runs while group g's layer is recomputed and differentiated. At any moment the
device holds at most the group in use and the group prefetched: two layers' inputs under checkpointing.

The copies themselves are a small strategy object:
  - `CudaCopies`: device -> pinned host on a side stream (`d2h`) that first waits for the compute
    stream (the tensor is complete), with `record_stream(d2h)` on the source so the caching allocator
    does not hand its memory to a later kernel before the copy has read it; host -> device on another
    side stream (`h2d`) that waits for the d2h copy's event; the compute stream waits for the h2d
    copy's event before using the tensor, and `record_stream(compute)` keeps the copy's memory (allocated
    on h2d) from being reused while compute kernels still read it.
  - `HostCopies`: synchronous copies into fresh host tensors, for a device that is host memory. The
    schedule is the same, which is how the tests exercise it without a GPU.

Every fetch is logged in `OffloadStats` (tensors and bytes brought back ahead of use vs on demand)
and, when the queue is given a list, as ("put" | "prefetch" | "fetch" | "take", index) events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class OffloadStats:
    """What the hooks did in the forward they last ran in, and the backward after it."""

    tensors: int = 0  # saved tensors copied to host memory
    bytes: int = 0
    kept: int = 0  # saved tensors left where they were (parameters, tensors on another device)
    prefetched: int = 0  # tensors copied back before backward asked for them (one group ahead)
    prefetched_bytes: int = 0
    on_demand: int = 0  # tensors copied back when backward asked for them (first group, or a re-run)
    on_demand_bytes: int = 0

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


class Copies(Protocol):
    """How a tensor goes to host memory and back (see the module docstring)."""

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def to_device(self, host: torch.Tensor, ready: Any, device: torch.device) -> tuple[torch.Tensor, Any]: ...

    def use(self, dev: torch.Tensor, done: Any) -> torch.Tensor: ...


class HostCopies:
    """Synchronous copies for a device that is host memory: nothing to order."""

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)
        host.copy_(t)
        return host, None

    def to_device(self, host: torch.Tensor, ready: Any, device: torch.device) -> tuple[torch.Tensor, Any]:
        return host.to(device, copy=True), None

    def use(self, dev: torch.Tensor, done: Any) -> torch.Tensor:
        return dev


class CudaCopies:
    """Copies on two side streams of `device`, ordered against its compute stream by events."""

    def __init__(self, device: torch.device) -> None:
        self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        self.d2h.wait_stream(torch.cuda.current_stream(t.device))  # t is written by kernels queued so far
        with torch.cuda.stream(self.d2h):
            host.copy_(t, non_blocking=True)
            ready = self.d2h.record_event()
        t.record_stream(self.d2h)  # the allocator may reuse t's memory only once this copy has read it
        return host, ready

    def to_device(self, host: torch.Tensor, ready: Any, device: torch.device) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(ready)  # the host copy is complete
            dev = host.to(device, non_blocking=True)
            done = self.h2d.record_event()
        return dev, done

    def use(self, dev: torch.Tensor, done: Any) -> torch.Tensor:
        compute = torch.cuda.current_stream(dev.device)
        compute.wait_event(done)
        dev.record_stream(compute)  # allocated on h2d, read by compute kernels: free only after them
        return dev


@dataclass
class _Entry:
    device: torch.device
    host: torch.Tensor
    ready: Any
    group: int
    fetched: tuple[torch.Tensor, Any] | None = None
    taken: bool = False


class OffloadQueue:
    """Host copies of saved tensors in forward order, grouped by checkpointed layer; see the module
    docstring for the schedule. `put` in forward, `take` from the unpack hook in backward."""

    def __init__(self, copies: Copies, stats: OffloadStats, log: list[tuple[str, int]] | None = None) -> None:
        self.copies, self.stats, self.log = copies, stats, log
        self.entries: list[_Entry] = []
        self.groups: dict[int, list[int]] = {}  # group -> indices of its entries
        self.group = 0

    def new_group(self) -> None:
        """A checkpointed layer starts its forward: what is saved from now on belongs to the next group."""
        self.group += 1

    def put(self, t: torch.Tensor) -> int:
        host, ready = self.copies.to_host(t)
        self.entries.append(_Entry(t.device, host, ready, self.group))
        self.groups.setdefault(self.group, []).append(len(self.entries) - 1)
        self.stats.tensors += 1
        self.stats.bytes += _nbytes(host)
        return self._note("put", len(self.entries) - 1)

    def take(self, index: int) -> torch.Tensor:
        entry = self.entries[index]
        if entry.fetched is None:
            self._fetch(index)
            self.stats.on_demand += 1
            self.stats.on_demand_bytes += _nbytes(entry.host)
        dev, done = entry.fetched
        entry.fetched, entry.taken = None, True  # the device copy now belongs to autograd alone
        self._note("take", index)
        self._prefetch(entry.group - 1)
        return self.copies.use(dev, done)

    def _fetch(self, index: int) -> None:
        entry = self.entries[index]
        entry.fetched = self.copies.to_device(entry.host, entry.ready, entry.device)
        self._note("fetch", index)

    def _prefetch(self, group: int) -> None:
        """Start copying back the tensors of `group` that backward has not taken yet."""
        for index in self.groups.get(group, ()):
            entry = self.entries[index]
            if entry.fetched is None and not entry.taken:
                entry.fetched = self.copies.to_device(entry.host, entry.ready, entry.device)
                self.stats.prefetched += 1
                self.stats.prefetched_bytes += _nbytes(entry.host)
                self._note("prefetch", index)

    def _note(self, what: str, index: int) -> int:
        if self.log is not None:
            self.log.append((what, index))
        return index


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
