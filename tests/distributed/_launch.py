"""Run a function in N local CPU processes joined by a gloo process group, and collect what each returns.

`run_distributed(fn, world_size, *args)` starts `world_size` processes (fork where available, so the
parent's imports are reused), initialises the default gloo group through a temporary file, calls
`fn(rank, world_size, *args)` in each and returns the per-rank return values (saved with torch.save).
An exception in any worker fails the call with that worker's traceback; a hung worker is killed
after `timeout_s`.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    init_file: str,
    out_dir: str,
    args: tuple[Any, ...],
    collective_timeout_s: float,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results in rank order."""
    start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory(prefix="rlsp_dist_") as tmp:
        init_file = os.path.join(tmp, "init")
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, init_file, tmp, args, timeout_s),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            # join() returns False while workers are still running and raises if one of them failed.
            while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed run of {fn.__name__} exceeded {timeout_s} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def layout_dims(ulysses: int = 1, ring: int = 1, tp: int = 1, fsdp_size: int = -1, sequence_parallel: bool = True,
                adaptive: bool = False):
    """The meshes of a one-node role layout over the current default group (call inside a worker)."""
    from rlsp.config.layout import RoleLayout, World
    from rlsp.parallel.mesh import build_parallel_dims

    layout = RoleLayout(World(1, dist.get_world_size()), ulysses=ulysses, ring=ring, tp=tp,
                        sequence_parallel=sequence_parallel, fsdp_size=fsdp_size, adaptive=adaptive)
    return build_parallel_dims(layout, "cpu")
