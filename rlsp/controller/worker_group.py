"""RayWorkerGroup: one Ray actor per rank of a training world, hosting a `Worker` and its roles.

Calls name a role and a method; the dispatch contract is the one the role method declares
(rlsp/workers/dispatch.py), never chosen at the call site. BY_DP splits over the dp groups of the
*role's* mesh (the critic may use another sp size than the actor on the same workers); its rows are a
StepData (rlsp/controller/step_data.py): each rank gets the declared columns of its rows, the ones
other processes hold straight from them, and what it returns stays with it. The rows are cut into equal
contiguous chunks, or, where a call gives `shards`, into contiguous shards of those row counts (the step
stage's whole prompt groups when they do not divide evenly over dp; a shard may be empty).
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rlsp.config.layout import ParallelLayout
from rlsp.controller.resource_pool import ResourcePool
from rlsp.controller.step_data import StepData, from_batch, from_results
from rlsp.controller.traffic import TRAFFIC
from rlsp.controller.worker_process import rank_env
from rlsp.data.batch import Batch
from rlsp.utils.logging import get_logger
from rlsp.workers.columns import COLUMNS_INFO, assemble
from rlsp.workers.dispatch import Dispatch, Fields, declared_fields, dispatch_mode
from rlsp.workers.roles import ROLE_CLASSES
from rlsp.workers.worker import Worker

log = get_logger("rlsp.controller")


class WorkerDiedError(RuntimeError):
    """A worker process ended (killed, out of memory, crashed) while the driver waited on it."""


# After a task failed: how long to look for a process that died in the same call. Its peers fail in their collectives
# ("Connection reset by peer") and may answer before Ray reports the death itself; the death is the cause to name.
PEER_DEATH_GRACE_S = 10.0


def _died(name: str, exc: Exception) -> WorkerDiedError:
    cause = str(exc).strip().splitlines()
    return WorkerDiedError(f"{name} died: {' '.join(cause[:3])[:600]}")


def _first_death(pending: list[Any], name_of_ref: Callable[[Any], str]) -> WorkerDiedError | None:
    """The first process among the tasks `pending` that died within PEER_DEATH_GRACE_S, named by its task's ref;
    None when none did (a task that fails otherwise is another peer's failure: keep looking behind it)."""
    deadline = time.monotonic() + PEER_DEATH_GRACE_S
    while pending and (left := deadline - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            return None
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as exc:
            return _died(name_of_ref(ready[0]), exc)
        except ray.exceptions.RayTaskError:
            continue
    return None


def _dead_peer(refs: list[Any], pending: list[Any], name_of: Callable[[int], str]) -> WorkerDiedError | None:
    """A process among `pending` (of the call `refs`) that died, named; None when none did (then the failed task's
    own error is the cause)."""
    return _first_death(pending, lambda ref: name_of(refs.index(ref)))


def gather_or_name(refs: list[Any], name_of: Callable[[int], str]) -> list[Any]:
    """Results of one call per process (`refs` in order). Fails as soon as any process dies, naming it
    (`name_of(index)`): the others may be blocked in a collective with it and would never return. A task that
    fails while a peer dies (its collective broke) reports the death, not its own broken connection."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as exc:
            raise _died(name_of(refs.index(ready[0])), exc) from None
        except ray.exceptions.RayTaskError:
            if (death := _dead_peer(refs, pending, name_of)) is not None:
                raise death from None
            raise
    return ray.get(refs)


# Every live worker group: a call that fails on an input whose owner died (rows another group's process produced and
# still holds, e.g. a killed rollout worker's samples) names that process, whichever group it belonged to.
_GROUPS: weakref.WeakSet[RayWorkerGroup] = weakref.WeakSet()


def _lost_input(exc: Exception) -> bool:
    """Whether a task failed because an object it needed was lost with its owner (or its object store)."""
    lost = (ray.exceptions.ObjectLostError,)
    return isinstance(exc, lost) or isinstance(getattr(exc, "cause", None), lost)


def dead_worker() -> WorkerDiedError | None:
    """A process of any live worker group that has died, named; None when every one answers or is busy (within
    PEER_DEATH_GRACE_S: a busy process's ping waits behind its task, a dead one's fails at once)."""
    pings = {w.__ray_ready__.remote(): (group, rank) for group in list(_GROUPS) for rank, w in enumerate(group.workers)}
    return _first_death(list(pings), lambda ref: pings[ref][0].rank_name(pings[ref][1]))


@dataclass
class PendingCall:
    """A dispatched call (one Ray task per rank, in rank order) whose results are collected later."""

    group: RayWorkerGroup
    refs: list[Any]  # what each rank answers the driver (ALL: its result; BY_DP: its report or metrics)
    firsts: list[int] | None  # BY_DP: the rank answering for each dp group; None: every rank's result (ALL)
    stays: list[Any] | None = None  # BY_DP: each rank's returned Batch, left where it was computed
    source: StepData | None = None  # BY_DP: the rows the call received
    fields: Fields | None = None
    groups: list[range] | None = None  # BY_DP: the positions of each dp group's rows

    def done(self) -> bool:
        return len(ray.wait(self.refs, num_returns=len(self.refs), timeout=0)[0]) == len(self.refs)

    def result(self) -> Any:
        """What `RayWorkerGroup.call` returns; raises WorkerDiedError naming a rank that died. BY_DP: a
        StepData when the method returns rows or columns (the rows stay on the workers; the driver holds
        the reported per-row values), else the answering ranks' results (metrics)."""
        results = self.group._gather(self.refs)
        TRAFFIC.wait()
        if self.firsts is None:
            TRAFFIC.receive(*results)
            return results
        firsts = [results[rank] for rank in self.firsts]
        TRAFFIC.receive(*firsts)
        if not isinstance(firsts[0], Batch):
            return firsts
        tensors, meta = firsts[0].info.pop(COLUMNS_INFO)  # every dp group returns the same columns
        for report in firsts[1:]:
            report.info.pop(COLUMNS_INFO, None)
        source = None if self.fields.new_rows else self.source
        held = ray.get([self.stays[r] for r in self.firsts])  # each a [reference] to a block its worker owns
        TRAFFIC.receive(*held)
        return from_results(source, self.groups, [h[0] for h in held], firsts, [*tensors, *meta], tensors)


def dp_row_ranges(rows: int, dp: int, shards: Sequence[int] | None = None) -> list[range]:
    """The positions of each dp group's rows in a BY_DP call of `rows` rows: `dp` equal contiguous chunks, or
    contiguous shards of `shards[g]` rows (any sizes, 0 included, summing to `rows`)."""
    if shards is None:
        if rows % dp != 0:
            raise ValueError(f"cannot split a batch of {rows} rows into {dp} equal chunks")
        shards = [rows // dp] * dp
    elif len(shards) != dp or sum(shards) != rows or min(shards) < 0:
        raise ValueError(f"shards={list(shards)}: need {dp} row counts (one per dp group, each >= 0) summing to the "
                         f"call's {rows} rows")
    starts = itertools.accumulate(shards, initial=0)
    return [range(start, start + size) for start, size in zip(starts, shards)]


class RayWorker(Worker):
    """The Worker as a Ray actor: what a BY_DP method returns is put into the object store by the worker
    itself, which owns it; the driver receives the reference (a few bytes), never the rows. (Returned
    directly, Ray would send small results to the caller's process.)"""

    def execute_rows(self, role: str, method: str, spec: Any, args: tuple[Any, ...], *blocks: Batch) -> tuple[Any, Any]:
        stay, answer = super().execute_rows(role, method, spec, args, *blocks)
        return ([ray.put(stay)] if stay is not None else None), answer

    def read_rows(self, spec: Any, *blocks: Batch) -> Batch:
        """The rows `spec` builds from `blocks`: how the driver reads a few columns of rows held elsewhere."""
        return assemble(spec, blocks)


class RayWorkerGroup:
    def __init__(self, pool: ResourcePool, layout: ParallelLayout, group: str, workers: list[Any]) -> None:
        """The group of `workers`, the processes `start_worker_processes` (rlsp.controller.worker_process)
        started in `pool`, in rank order; their `Worker`s get the config with `init_workers`."""
        self.pool, self.layout, self.group = pool, layout, group
        self.roles = layout.roles_of(group)
        self.world_size = pool.world_size
        self.workers = workers
        _GROUPS.add(self)

    def read_rows(self, spec: Any, *refs: Any) -> Batch:
        """The rows `spec` builds from the blocks `refs`, built by rank 0 (see RayWorker): how
        rlsp.controller.reads.read_columns brings worker-held columns to the driver."""
        TRAFFIC.call("read_rows")
        return ray.get(self.workers[0].read_rows.remote(spec, *refs))

    def rank_env(self, rank: int) -> dict[str, str]:
        return rank_env(self.pool, self.group, rank)

    def wait_started(self) -> None:
        """Block until every worker process is up and has built its `Worker` (imports included)."""
        self._gather([w.__ray_ready__.remote() for w in self.workers])

    def init_workers(self, config: dict[str, Any]) -> list[dict[str, Any]]:
        """Hand every worker the run's (checked, resolved) config and initialise the world collectively."""
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        infos = self.call_worker("init_worker", config, addr, port)
        log.info("%d %s workers initialised (%s)", self.world_size, self.group, self.layout.describe())
        return infos

    # ------------------------------------------------------------------ calls
    def call(self, role: str, method: str, *args: Any, shards: Sequence[int] | None = None) -> Any:
        """Call `role.method` on the workers with the contract the method declares; a BY_DP call's rows go to
        the dp groups in equal chunks, or `shards[g]` rows to dp group g (contiguous, in order)."""
        return self.submit(role, method, *args, shards=shards).result()

    def submit(self, role: str, method: str, *args: Any, shards: Sequence[int] | None = None) -> PendingCall:
        """`call` without waiting: the workers start now; `.result()` collects (or raises) later."""
        if role not in self.roles:
            raise ValueError(f"role {role!r} is not hosted by the {self.group} workers (they host {list(self.roles)})")
        mode = dispatch_mode(ROLE_CLASSES[role], method)
        if mode is Dispatch.ALL and shards is not None:
            raise ValueError(f"shards={list(shards)} given to {role}.{method}, which every rank runs on the same "
                             "arguments (Dispatch.ALL): shards cut the rows of BY_DP calls only")
        TRAFFIC.call(f"{role}.{method}", self.world_size)
        if mode is Dispatch.ALL:
            return self._all(lambda w, *a: w.execute.remote(role, method, *a), args)
        return self._by_dp(role, method, args, shards)

    def call_worker(self, method: str, *args: Any) -> Any:
        """Call a method of the worker itself (set-up, weight sync, shutdown); always ALL."""
        dispatch_mode(Worker, method)
        TRAFFIC.call(method, self.world_size)
        return self._all(lambda w, *a: getattr(w, method).remote(*a), args).result()

    def _all(self, submit, args: tuple[Any, ...]) -> PendingCall:
        TRAFFIC.send(*args)  # once: Ray stores each argument once for all ranks
        return PendingCall(self, [submit(w, *args) for w in self.workers], None)

    def _by_dp(self, role: str, method: str, args: tuple[Any, ...], shards: Sequence[int] | None) -> PendingCall:
        """One row shard per dp group (the dp groups' ranks are consecutive: dp is the outermost dimension
        of every role's layout); each rank receives the declared columns of its group's rows: the
        driver's by value, the rest as the blocks that hold them."""
        data, rest = args[0], args[1:]
        data = from_batch(data) if isinstance(data, Batch) else data
        fields = declared_fields(ROLE_CLASSES[role], method)
        per_dp = self.layout.role(role).ranks_per_dp
        dp = self.world_size // per_dp
        groups = dp_row_ranges(len(data), dp, shards)
        specs = [data.spec(rows, fields.reads) for rows in groups]
        TRAFFIC.send(rest, *specs)
        spec_refs = [ray.put(spec) for spec, _ in specs]  # shared by the group's ulysses/ring/tp ranks
        stays, refs = [], []
        for rank, w in enumerate(self.workers):
            g = rank // per_dp
            stay, answer = w.execute_rows.options(num_returns=2).remote(role, method, spec_refs[g], rest, *specs[g][1])
            stays.append(stay)  # [the worker's reference to its result], or None
            refs.append(answer)
        return PendingCall(self, refs, [g * per_dp for g in range(dp)], stays, data, fields, groups)

    def rank_name(self, rank: int) -> str:
        """How errors name a rank of this group."""
        return f"{self.group} worker rank {rank} of {self.world_size}"

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Results of one call per rank (refs in rank order); raises WorkerDiedError naming a dead rank, also a
        dead process of another group whose rows the call's inputs were (`dead_worker`)."""
        try:
            return gather_or_name(refs, self.rank_name)
        except ray.exceptions.RayTaskError as exc:
            if _lost_input(exc) and (death := dead_worker()) is not None:
                raise death from exc
            raise

    def shutdown(self, graceful: bool = True) -> None:
        """Release the workers; `graceful` first lets them close their process groups (bounded wait)."""
        _GROUPS.discard(self)  # its processes end here: no longer a death to name
        if graceful:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=10)
            except Exception as exc:  # a dead worker must not hide the original error
                log.warning("worker shutdown failed: %s", exc)
        for w in self.workers:
            ray.kill(w)
        self.pool.release()
