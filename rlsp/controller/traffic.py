"""What crosses the driver: bytes the driver sends to and receives from other processes, per step.

Counted where the driver hands objects to Ray (arguments of worker calls, objects it puts) and where it
reads results (`ray.get`). Sizes are the payload: tensors and arrays by their bytes, text by its
length, object handles by the size of an id, anything else by its pickled size. The trainer logs the
counts of each step as `perf/driver_bytes` (sent + received), `perf/driver_bytes_sent` and
`perf/driver_bytes_received`, and the driver's peak resident memory as `perf/driver_peak_rss_gib`; with them
the remote method calls it submits (`perf/driver_calls`, one per process called) and the round trips in
which it waits for results (`perf/driver_waits`).
"""

from __future__ import annotations

import pickle
import resource
import sys
from collections import Counter
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

REF_BYTES = 28  # an object id


def payload_bytes(obj: Any) -> int:
    """The bytes `obj` carries (see the module docstring)."""
    if obj is None or isinstance(obj, (bool, int, float)):
        return 8
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, (str, bytes)):
        return len(obj)
    if isinstance(obj, TensorDict):
        return sum(payload_bytes(obj[k]) for k in obj.keys())
    if isinstance(obj, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(payload_bytes(x) for x in obj)
    if type(obj).__name__ == "ObjectRef":
        return REF_BYTES
    if hasattr(obj, "__dataclass_fields__"):
        return sum(payload_bytes(getattr(obj, name)) for name in obj.__dataclass_fields__)
    try:
        return len(pickle.dumps(obj))
    except Exception:  # an unpicklable handle (an actor): an id's worth
        return REF_BYTES


class Traffic:
    """Running byte counts of the driver process; `take()` returns and resets them."""

    def __init__(self) -> None:
        self.sent = self.received = self.waits = 0
        self.by_method: Counter[str] = Counter()  # remote calls per method name (what a step is made of)
        self.last_by_method: dict[str, int] = {}

    def send(self, *objs: Any) -> None:
        self.sent += sum(payload_bytes(o) for o in objs)

    def receive(self, *objs: Any) -> None:
        self.received += sum(payload_bytes(o) for o in objs)

    def call(self, method: str, n: int = 1) -> None:
        """`n` remote method calls (one per process called) the driver submits."""
        self.by_method[method] += n

    @property
    def calls(self) -> int:
        """Remote calls submitted since the last reset."""
        return sum(self.by_method.values())

    def wait(self) -> None:
        """One round trip: the driver blocks until results it needs are back."""
        self.waits += 1

    def reset(self) -> None:
        self.sent = self.received = self.waits = 0
        self.by_method.clear()

    def take(self) -> dict[str, float]:
        out = {"perf/driver_bytes": float(self.sent + self.received), "perf/driver_bytes_sent": float(self.sent),
               "perf/driver_bytes_received": float(self.received), "perf/driver_peak_rss_gib": peak_rss_gib(),
               "perf/driver_calls": float(self.calls), "perf/driver_waits": float(self.waits)}
        self.last_by_method = dict(self.by_method)  # the step's calls per method (benchmarks/grpo_step.py)
        self.reset()
        return out


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far (GiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / (1024**3 if sys.platform == "darwin" else 1024**2)


TRAFFIC = Traffic()  # the driver's counts (one driver per process)
