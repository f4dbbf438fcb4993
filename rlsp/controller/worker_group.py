"""RayWorkerGroup: spawn one Ray actor per rank from a plain worker class; dispatch and collect.

Dispatch modes:
  * by rank: the batch is split into `world` equal parts (generation: every rank samples its part);
  * by dp:   the batch is split into `dp` parts; every sp rank of dp group g gets part g, and the
             result of each group's sp-rank 0 is collected (all ranks must run: the call is collective).
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsp.controller.resource_pool import ResourcePool
from rlsp.data.batch import Batch
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.controller")


class RayWorkerGroup:
    def __init__(self, worker_cls: type, pool: ResourcePool, config: dict[str, Any], sp_size: int,
                 env_vars: dict[str, str] | None = None) -> None:
        self.pool, self.sp_size = pool, sp_size
        self.world_size = pool.world_size
        pg = pool.pg if pool.pg is not None else pool.create()
        remote_cls = ray.remote(worker_cls)
        bundle = pool.bundle()
        self.workers = []
        for rank in range(self.world_size):
            env = {**(env_vars or {}), **self._rank_env(rank)}
            self.workers.append(remote_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env},
            ).remote(config, rank, self.world_size))

    def _rank_env(self, rank: int) -> dict[str, str]:
        env = {"RANK": str(rank), "WORLD_SIZE": str(self.world_size)}
        if self.pool.device_type == "cpu":
            # Each worker gets its own cores: vLLM binds its OpenMP threads, so give disjoint ranges.
            c = self.pool.cpus_per_worker
            first = (rank % self.pool.procs_per_node) * c
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{first}-{first + c - 1}" if c > 1 else str(first)
            env["OMP_NUM_THREADS"] = str(c)
        return env

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def init_workers(self) -> list[dict[str, Any]]:
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        infos = ray.get([w.init_worker.remote(addr, port) for w in self.workers])
        log.info("%d workers initialised (dp=%d, sp=%d)", self.world_size, self.dp_size, self.sp_size)
        return infos

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def dispatch_by_rank(self, method: str, batch: Batch, *args: Any) -> Batch:
        parts = batch.chunk(self.world_size)
        refs = [getattr(w, method).remote(p, *args) for w, p in zip(self.workers, parts)]
        return Batch.concat(ray.get(refs))

    def dispatch_by_dp(self, method: str, batch: Batch | None, *args: Any) -> list[Any]:
        """Returns one result per dp group (from its sp-rank 0), in dp order."""
        parts = batch.chunk(self.dp_size) if batch is not None else [None] * self.dp_size
        refs = []
        for rank, w in enumerate(self.workers):
            part = parts[rank // self.sp_size]
            refs.append(getattr(w, method).remote(*(() if part is None else (part,)), *args))
        results = ray.get(refs)
        return [results[g * self.sp_size] for g in range(self.dp_size)]

    def dispatch_batch_by_dp(self, method: str, batch: Batch) -> Batch:
        return Batch.concat(self.dispatch_by_dp(method, batch))

    def shutdown(self) -> None:
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=30)
        except Exception as exc:  # a dead worker must not hide the original error
            log.warning("worker shutdown failed: %s", exc)
        for w in self.workers:
            ray.kill(w)
        self.pool.release()
