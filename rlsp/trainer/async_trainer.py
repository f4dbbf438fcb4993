"""AsyncTrainer: generation on a rollout pool of its own, overlapped with training (verl's
`async_training.*` with `rollout.nnodes` x `rollout.n_gpus_per_node` rollout workers).

The loop keeps a queue of generation calls ahead of the trainer:

    before step j: submit batches j, j+1, ... while (batch - 1) - pushed_version <= max_staleness
    step j:        wait for batch j -> train on it (RayTrainer.train_on) -> actor version j
                   -> every trigger_parameter_sync_step versions: weights to the rollout pool

`pushed_version` is the newest weights version sent to the pool; a batch submitted after a push is
generated with it (a Ray actor runs its calls in order). max_staleness = trigger_parameter_sync_step
- 1 + floor(staleness_threshold x trigger_parameter_sync_step): with 0 and 1 the pipeline is the
synchronous one (same samples, same updates); staleness_threshold=1 is one-step off-policy (batch
j+1 generated while the trainer works on batch j). Every sample carries the `policy_version` that
generated it; its staleness is the trainer's version minus that.

Weights go trainer -> driver's object store -> rollout workers: the actor's rank 0 returns the full
tensors (one gather per parameter, as the colocated sync does) and every rollout worker reads that one
object. The two pools are separate torch worlds, so a direct collective would need a third process
group spanning both (verl's parameter synchroniser builds one over NCCL); on one CPU node the object
store is already a shared-memory copy.

A checkpoint records the data position of the last *trained* batch: batches generated ahead are
dropped when a run stops, and a resumed run generates them again with weights it has.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from rlsp.config.layout import ParallelLayout
from rlsp.config.validate_async import max_staleness
from rlsp.controller.resource_pool import ResourcePool, default_cpus_per_worker
from rlsp.controller.worker_group import PendingCall, RayWorkerGroup
from rlsp.data.batch import Batch
from rlsp.trainer.ray_trainer import RayTrainer, _prompt_batch, worker_env
from rlsp.utils.device import resolve_device_type
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.trainer")


@dataclass
class InFlight:
    """A generation call for one training step."""

    step: int
    data_pos: tuple[int, int]  # the data position once this batch is consumed
    call: PendingCall


class AsyncTrainer(RayTrainer):
    def __init__(self, cfg: DictConfig, layout: ParallelLayout) -> None:
        super().__init__(cfg, layout)
        self.pool_wg: RayWorkerGroup | None = None
        self.window = int(cfg.async_training.trigger_parameter_sync_step)
        self.max_staleness = max_staleness(cfg)
        self.pushed_version: int | None = None
        self.syncs: list[PendingCall] = []  # weight loads on the pool not yet checked
        self.totals = {"trainer_idle_s": 0.0, "rollout_busy_s": 0.0}

    @property
    def rollout_wg(self) -> RayWorkerGroup:
        return self.pool_wg

    def start_workers(self) -> list[dict[str, Any]]:
        infos = super().start_workers()
        t0 = time.perf_counter()
        pool, device_type = self.layout.rollout, resolve_device_type(self.cfg.trainer.device)
        cpus = 1 if device_type == "cuda" else default_cpus_per_worker(self.layout.total_workers)
        first_core = 0 if device_type == "cuda" else (self.layout.total_workers - pool.world_size) * cpus
        resources = ResourcePool(pool.nnodes, pool.procs_per_node, device_type, cpus, name="rollout",
                                 first_core=first_core)
        self.pool_wg = RayWorkerGroup(resources, OmegaConf.to_container(self.cfg, resolve=True), self.layout,
                                      "rollout", env_vars=worker_env(self.cfg))
        self.pool_wg.wait_started()
        infos += self.pool_wg.init_workers()
        self.startup["startup/rollout_pool_s"] = time.perf_counter() - t0
        return infos

    def _groups(self) -> list[RayWorkerGroup]:
        return super()._groups() + ([self.pool_wg] if self.pool_wg is not None else [])

    # ------------------------------------------------------------------ weights
    def sync_rollout(self, step: int) -> None:
        """After `step` actor updates: push the weights every trigger_parameter_sync_step versions."""
        if step % self.window == 0:
            self._push(step)

    def _push(self, version: int) -> None:
        export = self.wg.submit("actor", "export_rollout_weights", str(self.cfg.actor_rollout_ref.rollout.dtype))
        # Rank 0's result (the weights) goes to the pool as an object reference, never through the driver.
        self.syncs.append(self.pool_wg.submit("rollout", "set_weights", export.refs[0], version))
        ray.wait(export.refs[:1])
        self.wg._gather(export.refs[1:])  # the other ranks took part in the gathers; raise if one failed
        self.pushed_version = version

    def _check_syncs(self) -> None:
        """Raise a failed weight load (it ran before the generation just collected, on the same workers)."""
        for call in [c for c in self.syncs if c.done()]:
            call.result()
            self.syncs.remove(call)

    # ------------------------------------------------------------------ loop
    def run_steps(self, total: int):
        """(step, metrics) of each step, generation running up to max_staleness versions ahead."""
        if self.pushed_version != self.start_step - 1:  # a fresh or resumed run: the pool gets its weights
            self._push(self.start_step - 1)
        stream, queue = self._batch_stream(), deque()
        next_step, started = self.start_step, time.perf_counter()
        for step in range(self.start_step, total + 1):
            while next_step <= total and (next_step - 1) - self.pushed_version <= self.max_staleness:
                items = next(stream)
                call = self.rollout_wg.submit("rollout", "generate", _prompt_batch(items), self._sampling(next_step))
                queue.append(InFlight(next_step, self.data_pos, call))
                next_step += 1
            job = queue.popleft()
            t0 = time.perf_counter()
            batch = job.call.result()
            waited = time.perf_counter() - t0
            self._check_syncs()
            metrics = self.train_on(step, batch, t0, {"timing/gen_s": float(batch.info["gen_s"])})
            self.data_pos = job.data_pos  # what a checkpoint of this step continues from
            metrics.update(self._async_metrics(step, batch, waited, len(queue), time.perf_counter() - started))
            yield step, metrics

    def _async_metrics(self, step: int, batch: Batch, waited: float, depth: int, wall: float) -> dict[str, float]:
        staleness = (step - 1) - batch["policy_version"].double()
        self.totals["trainer_idle_s"] += waited
        self.totals["rollout_busy_s"] += float(batch.info["gen_s"])
        return {
            "async/policy_version": float(step - 1),
            "async/staleness_mean": float(staleness.mean()),
            "async/staleness_max": float(staleness.max()),
            "async/queue_depth": float(depth),
            "async/trainer_idle_s": waited,
            "async/rollout_busy_s": float(batch.info["gen_s"]),
            "async/trainer_idle_ratio": self.totals["trainer_idle_s"] / max(wall, 1e-9),
            "async/rollout_idle_ratio": max(0.0, 1.0 - self.totals["rollout_busy_s"] / max(wall, 1e-9)),
        }
