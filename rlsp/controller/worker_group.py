"""RayWorkerGroup: one Ray actor per rank of a training world, hosting a `Worker` and its roles.

Calls name a role and a method; the dispatch contract is the one the role method declares
(rlsp/workers/dispatch.py), never chosen at the call site. BY_DP splits over the dp groups of the
*role's* mesh (the critic may use another sp size than the actor on the same workers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsp.config.layout import ParallelLayout
from rlsp.controller.resource_pool import ResourcePool
from rlsp.data.batch import Batch
from rlsp.utils.logging import get_logger
from rlsp.workers.dispatch import Dispatch, dispatch_mode
from rlsp.workers.roles import ROLE_CLASSES
from rlsp.workers.worker import Worker

log = get_logger("rlsp.controller")


class WorkerDiedError(RuntimeError):
    """A worker process ended (killed, out of memory, crashed) while the driver waited on it."""


def gather_or_name(refs: list[Any], name_of: Callable[[int], str]) -> list[Any]:
    """Results of one call per process (`refs` in order). Fails as soon as any process dies, naming it
    (`name_of(index)`): the others may be blocked in a collective with it and would never return."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as exc:
            cause = str(exc).strip().splitlines()
            raise WorkerDiedError(f"{name_of(refs.index(ready[0]))} died: {' '.join(cause[:3])[:600]}") from None
    return ray.get(refs)


@dataclass
class PendingCall:
    """A dispatched call (one Ray task per rank, in rank order) whose results are collected later."""

    group: RayWorkerGroup
    refs: list[Any]
    firsts: list[int] | None  # BY_DP: the rank answering for each dp group; None: every rank's result (ALL)

    def done(self) -> bool:
        return len(ray.wait(self.refs, num_returns=len(self.refs), timeout=0)[0]) == len(self.refs)

    def result(self) -> Any:
        """What `RayWorkerGroup.call` returns; raises WorkerDiedError naming a rank that died."""
        results = self.group._gather(self.refs)
        if self.firsts is None:
            return results
        firsts = [results[rank] for rank in self.firsts]
        return Batch.concat(firsts) if isinstance(firsts[0], Batch) else firsts


class RayWorkerGroup:
    def __init__(self, pool: ResourcePool, config: dict[str, Any], layout: ParallelLayout, group: str,
                 env_vars: dict[str, str] | None = None) -> None:
        self.pool, self.layout, self.group = pool, layout, group
        self.roles = layout.roles_of(group)
        self.world_size = pool.world_size
        pg = pool.pg if pool.pg is not None else pool.create(layout.node_local_sizes(group))
        remote_cls = ray.remote(Worker)
        bundle = pool.bundle()
        self.workers = []
        for rank in range(self.world_size):
            env = {**(env_vars or {}), **self.rank_env(rank)}
            self.workers.append(remote_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=pool.rank_to_bundle[rank]),
                runtime_env={"env_vars": env}, name=f"rlsp-{group}-{rank}-{id(self):x}",
            ).remote(config, layout, group, rank))

    def rank_env(self, rank: int) -> dict[str, str]:
        env = {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "RLSP_WORKER_GROUP": self.group}
        if self.pool.device_type == "cpu":
            # Each worker gets its own cores: vLLM binds its OpenMP threads, so give disjoint ranges.
            c = self.pool.cpus_per_worker
            first = self.pool.first_core + (rank % self.pool.procs_per_node) * c
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{first}-{first + c - 1}" if c > 1 else str(first)
            env["OMP_NUM_THREADS"] = str(c)
        return env

    def wait_started(self) -> None:
        """Block until every worker process is up and has built its `Worker` (imports included)."""
        self._gather([w.__ray_ready__.remote() for w in self.workers])

    def init_workers(self) -> list[dict[str, Any]]:
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        infos = self.call_worker("init_worker", addr, port)
        log.info("%d %s workers initialised (%s)", self.world_size, self.group, self.layout.describe())
        return infos

    # ------------------------------------------------------------------ calls
    def call(self, role: str, method: str, *args: Any) -> Any:
        """Call `role.method` on the workers with the contract the method declares."""
        return self.submit(role, method, *args).result()

    def submit(self, role: str, method: str, *args: Any) -> PendingCall:
        """`call` without waiting: the workers start now; `.result()` collects (or raises) later."""
        if role not in self.roles:
            raise ValueError(f"role {role!r} is not hosted by the {self.group} workers (they host {list(self.roles)})")
        mode = dispatch_mode(ROLE_CLASSES[role], method)
        ranks_per_dp = self.layout.role(role).ranks_per_dp
        return self._dispatch(mode, ranks_per_dp, lambda w, *a: w.execute.remote(role, method, *a), args)

    def call_worker(self, method: str, *args: Any) -> Any:
        """Call a method of the worker itself (set-up, weight sync, shutdown); always ALL."""
        mode = dispatch_mode(Worker, method)
        return self._dispatch(mode, 1, lambda w, *a: getattr(w, method).remote(*a), args).result()

    def _dispatch(self, mode: Dispatch, per_dp: int, submit, args: tuple[Any, ...]) -> PendingCall:
        if mode is Dispatch.ALL:
            return PendingCall(self, [submit(w, *args) for w in self.workers], None)
        batch, rest = args[0], args[1:]
        # BY_DP: one shard per dp group, shipped once and shared by the group's ulysses/ring/tp ranks
        # (consecutive ranks: dp is the outermost dimension of every role's layout).
        dp = self.world_size // per_dp
        part_refs = [ray.put(p) for p in batch.chunk(dp)]
        refs = [submit(w, part_refs[rank // per_dp], *rest) for rank, w in enumerate(self.workers)]
        return PendingCall(self, refs, [g * per_dp for g in range(dp)])

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Results of one call per rank (refs in rank order); raises WorkerDiedError naming a dead rank."""
        return gather_or_name(refs, lambda rank: f"{self.group} worker rank {rank} of {self.world_size}")

    def shutdown(self, graceful: bool = True) -> None:
        """Release the workers; `graceful` first lets them close their process groups (bounded wait)."""
        if graceful:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=10)
            except Exception as exc:  # a dead worker must not hide the original error
                log.warning("worker shutdown failed: %s", exc)
        for w in self.workers:
            ray.kill(w)
        self.pool.release()
