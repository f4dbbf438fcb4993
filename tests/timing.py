"""Time bounds that scale with the machine the suite runs on.

A test that checks how fast something happens (a stop, a refusal, a cached call) states its bound as it
holds on a quiet machine and checks the elapsed time against `allowed(elapsed_s, quiet_bound_s)`: the
bound itself while the time is within it, else the bound times how much slower this machine is right now
than a quiet one. CI's 2-core machines differ 2x in speed, and a second CPU-heavy process beside the
suite took a stop that needs 8 s on a quiet machine to 16.8 s, past a fixed 15 s bound.

How much slower (`slowdown`): a fixed pure-Python loop runs in one process per usable core at once, and
its wall time is divided by REFERENCE_S, the time it takes on a quiet machine. One process per core
because the work being timed keeps every core busy (the driver, Ray's GCS, raylet and agents, the
workers), so a second busy core slows it as it slows the reference (x1.5 on 2 cores), and a slower CPU
does too. It is measured after the timed work, only where the quiet bound was exceeded: a quiet machine
pays nothing. Never below 1: a faster machine keeps the stated bound.

A bound that guards against a known failure (a driver that waited 60 s for a dead GCS) passes `cap_s`,
below that failure: however slow the machine, the bound never grows to where it cannot tell them apart.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

# Wall time of `reference_s()` on a quiet 2-core machine (the development VM this suite was written on,
# each core about as fast as CI's faster machines): about the CPU time one loop takes there, 0.47-0.5 s.
REFERENCE_S = 0.5
_LOOP = "n = 0\nfor i in range(7_000_000):\n    n += i\n"


def reference_s() -> float:
    """Seconds the reference loop takes, one process per usable core at once, on this machine now."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-S", "-c", _LOOP]) for _ in range(cores)]
    for proc in procs:
        proc.wait()
    return time.monotonic() - t0


def slowdown() -> float:
    """How many times slower than the quiet reference machine this one is now (at least 1)."""
    return max(1.0, reference_s() / REFERENCE_S)


def allowed(elapsed_s: float, quiet_bound_s: float, cap_s: float | None = None) -> float:
    """The bound `elapsed_s` must be within: `quiet_bound_s` where it is, else that times `slowdown()`
    (at most `cap_s`)."""
    if elapsed_s <= quiet_bound_s:
        return quiet_bound_s
    factor = slowdown()
    bound = quiet_bound_s * factor if cap_s is None else min(quiet_bound_s * factor, cap_s)
    print(f"timing: {elapsed_s:.1f}s > the quiet bound {quiet_bound_s:g}s; this machine is {factor:.2f}x slower "
          f"than a quiet one now: bound {bound:.1f}s")
    return bound
