"""The worker processes of a pool: Ray actors of `WorkerProcess`, a class whose module imports neither
torch nor transformers, so that the driver can start them before it has imported either.

A process imports rlsp's worker stack (torch, transformers, the roles: ~4 s of CPU on these machines) when
its `WorkerProcess` is built, and hosts a `RayWorker` (rlsp.controller.worker_group) without the run's
config, which comes with `init_worker`. Every public method of `RayWorker` is forwarded under its own
name (`WORKER_METHODS`, checked against the class by tests/unit/test_worker_process.py), so callers use
the actor handles as they would a `RayWorker`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsp.config.layout import ParallelLayout
from rlsp.controller.resource_pool import ResourcePool

WORKER_METHODS = ("configure", "execute", "execute_rows", "init_worker", "load_rng", "read_rows",
                  "rendezvous_address", "save_rng", "score", "shutdown", "sync_weights")


class WorkerProcess:
    """One rank's process: builds its `RayWorker` (importing the worker stack) and forwards its calls."""

    def __init__(self, layout: ParallelLayout, group: str, rank: int) -> None:
        from rlsp.controller.worker_group import RayWorker  # the heavy imports, in the worker process only

        self.worker = RayWorker(layout, group, rank)


def _forward(name: str) -> Callable[..., Any]:
    def method(self: WorkerProcess, *args: Any) -> Any:
        return getattr(self.worker, name)(*args)

    method.__name__ = method.__qualname__ = name
    return method


for _name in WORKER_METHODS:
    setattr(WorkerProcess, _name, _forward(_name))


def rank_env(pool: ResourcePool, group: str, rank: int) -> dict[str, str]:
    """The environment of `rank`'s process: its rank, and on CPU the cores it binds."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(pool.world_size), "RLSP_WORKER_GROUP": group}
    if pool.device_type == "cpu":
        # Each worker gets its own cores: vLLM binds its OpenMP threads, so give disjoint ranges.
        c = pool.cpus_per_worker
        first = pool.first_core + (rank % pool.procs_per_node) * c
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"{first}-{first + c - 1}" if c > 1 else str(first)
        env["OMP_NUM_THREADS"] = str(c)
    return env


def start_worker_processes(pool: ResourcePool, layout: ParallelLayout, group: str,
                           env_vars: dict[str, str] | None = None) -> list[Any]:
    """Reserve `pool` (unless reserved) and start one `WorkerProcess` per rank in its bundles; the actor
    handles in rank order (not waited for: `__ray_ready__` says when each is up)."""
    pg = pool.pg if pool.pg is not None else pool.create(layout.node_local_sizes(group))
    remote_cls = ray.remote(WorkerProcess)
    bundle = pool.bundle()
    return [remote_cls.options(
        num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=pool.rank_to_bundle[rank]),
        runtime_env={"env_vars": {**(env_vars or {}), **rank_env(pool, group, rank)}},
        name=f"rlsp-{group}-{rank}-{id(pool):x}",
    ).remote(layout, group, rank) for rank in range(pool.world_size)]
