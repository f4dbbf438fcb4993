"""AsyncTrainer: generation on a rollout pool of its own, overlapped with training (verl's
`async_training.*` with `rollout.nnodes` x `rollout.n_gpus_per_node` rollout workers).

Generation streams in units of `ppo_mini_batch_size` prompts (verl's mini-batches); a trainer step
trains on the concatenation of `require_batches` units (= data.train_batch_size prompts). The loop
keeps generation calls queued ahead of the trainer, unit by unit:

    before step j: submit units u = 0, 1, ... (global index) while u < pushed_version x require_batches
                   + max_units_ahead, where max_units_ahead = floor((1 + staleness_threshold) x
                   trigger_parameter_sync_step x require_batches)   (verl's max_required_samples, in units)
    step j:        wait for its require_batches units -> train on them (RayTrainer.train_on) -> version j
                   -> every trigger_parameter_sync_step versions: weights to the rollout pool

`pushed_version` is the newest weights version sent to the pool; a unit submitted after a push is
generated with it (or newer weights, with partial rollouts). With staleness_threshold=0 and
trigger_parameter_sync_step=1 the pipeline is the synchronous one (same samples, same updates: a
prompt's sampling seed depends on its index in the step's batch, not on the unit it travels in);
staleness_threshold=1 is one-step off-policy. Every sample carries `policy_version`, the oldest
version among its tokens; its staleness is the trainer's version minus that.

Weights go trainer -> object store -> rollout workers: the actor's rank 0 returns the full tensors
(one gather per parameter, as the colocated sync does) and every rollout worker reads that one object.
Without partial rollouts a `set_weights` call queues on each rollout worker behind the generation
calls already submitted; with `partial_rollout=true` the driver publishes (version, weights ref) on a
WeightBoard (rlsp/controller/weight_board.py) that the workers poll between generation segments, so a
running generation continues with the new weights from its next segment on.

With dynamic sampling (algorithm.filter_groups) a step takes further units from the queue until it has
data.train_batch_size prompts with informative groups; those extra units do not count against the bound
(`extra_units`: the queue may run that many units further ahead). rlsp/step/dynamic_sampling.py.

A checkpoint records the data position of the last *trained* batch: units generated ahead are
dropped when a run stops, and a resumed run generates them again with weights it has.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import ray
import torch
from omegaconf import DictConfig, OmegaConf

from rlsp.config.layout import ParallelLayout
from rlsp.controller.step_data import StepData
from rlsp.controller.traffic import TRAFFIC
from rlsp.controller.training_workers import start_pool
from rlsp.controller.weight_board import BoardFeed, start_weight_board
from rlsp.controller.worker_group import PendingCall, RayWorkerGroup
from rlsp.controller.worker_pools import PoolSettings, StartedPool
from rlsp.data.batch import Batch
from rlsp.trainer.ray_trainer import RayTrainer
from rlsp.trainer.rollout_inputs import prompt_batch, sampling_params
from rlsp.trainer.staleness import max_units_ahead
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.trainer")


@dataclass
class InFlight:
    """A generation call for one unit (ppo_mini_batch_size prompts) of a training step."""

    step: int
    data_pos: tuple[int, int]  # the data position once the step's batch is consumed
    call: PendingCall


class AsyncTrainer(RayTrainer):
    def __init__(self, cfg: DictConfig, layout: ParallelLayout) -> None:
        super().__init__(cfg, layout)
        a = cfg.async_training
        self.pool_wg: RayWorkerGroup | None = None
        self.board: Any = None  # partial rollouts: where the pool picks up new weights
        self.partial = bool(a.partial_rollout)
        self.window, self.units_per_step = int(a.trigger_parameter_sync_step), int(a.require_batches)
        self.unit_size = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
        self.max_units = max_units_ahead(cfg)
        self.pushed_version: int | None = None
        self.syncs: list[PendingCall] = []  # weight loads on the pool not yet checked
        self.totals = {"trainer_idle_s": 0.0, "rollout_busy_s": 0.0}
        self.queue: deque[InFlight] = deque()
        self.next_unit = 0  # global index of the next unit to submit
        self.extra_units = 0  # units taken beyond require_batches to replace filtered groups (dynamic sampling)
        self._step_items: list[dict[str, Any]] = []  # the prompts of the step whose units are being submitted
        self._step_pos = (0, 0)  # and the data position once that step's batch is consumed

    @property
    def rollout_wg(self) -> RayWorkerGroup:
        return self.pool_wg

    def start_workers(self, pools: list[StartedPool] | None = None) -> list[dict[str, Any]]:
        infos = super().start_workers(pools)
        t0 = time.perf_counter()
        self.pool_wg = start_pool(PoolSettings.of(self.cfg), self.layout, "rollout")
        self.pool_wg.wait_started()
        infos += self.pool_wg.init_workers(OmegaConf.to_container(self.cfg, resolve=True))
        if self.partial:
            self.board = start_weight_board(f"rlsp-weights-{id(self):x}")
            self.pool_wg.call("rollout", "follow_weights", BoardFeed(self.board))
        self.startup["startup/rollout_pool_s"] = time.perf_counter() - t0
        return infos

    def _groups(self) -> list[RayWorkerGroup]:
        return super()._groups() + ([self.pool_wg] if self.pool_wg is not None else [])

    def shutdown(self, graceful: bool = True) -> None:
        super().shutdown(graceful)
        if self.board is not None:
            ray.kill(self.board)
            self.board = None

    # ------------------------------------------------------------------ weights
    def sync_rollout(self, step: int) -> None:
        """After `step` actor updates: push the weights every trigger_parameter_sync_step versions."""
        if step % self.window == 0:
            self._push(step)

    def _push(self, version: int) -> None:
        export = self.wg.submit("actor", "export_rollout_weights", str(self.cfg.actor_rollout_ref.rollout.dtype))
        if not self.partial:
            # Rank 0's result (the weights) goes to the pool as an object reference, never through the driver.
            self.syncs.append(self.pool_wg.submit("rollout", "set_weights", export.refs[0], version))
        ray.wait(export.refs[:1])
        self.wg._gather(export.refs[1:])  # the other ranks took part in the gathers; raise if one failed
        if self.partial:  # published once exported: a worker polling the board never waits for the trainer
            ray.get(self.board.publish.remote(version, [export.refs[0]]))
        self.pushed_version = version

    def _check_syncs(self) -> None:
        """Raise a failed weight load (it ran before the generation just collected, on the same workers)."""
        for call in [c for c in self.syncs if c.done()]:
            call.result()
            self.syncs.remove(call)

    # ------------------------------------------------------------------ loop
    def run_steps(self, total: int):
        """(step, metrics) of each step, generation running up to max_units_ahead units ahead."""
        if self.pushed_version != self.start_step - 1:  # a fresh or resumed run: the pool gets its weights
            self._push(self.start_step - 1)
        stream, started = self._batch_stream(), time.perf_counter()
        self.queue.clear()
        self.next_unit, self.extra_units = (self.start_step - 1) * self.units_per_step, 0
        for step in range(self.start_step, total + 1):
            TRAFFIC.reset()  # perf/driver_bytes: this step's traffic, the units it submits ahead included
            self._submit_ahead(stream, total)
            t0, timing, sampled = time.perf_counter(), {}, {}
            if self.sampler is None:
                units = [self.queue.popleft() for _ in range(self.units_per_step)]
                parts = [u.call.result() for u in units]
                batch = StepData.concat(parts)
            else:  # dynamic sampling: more units until enough groups are informative
                take = lambda extra: self._take_unit(stream, total, extra)  # noqa: E731
                units, parts, batch, sampled = self.sampler.collect_units(take, self.units_per_step, self.reward, timing,
                                                                          self.read)
            waited = time.perf_counter() - t0 - timing.get("timing/reward_s", 0.0)
            self._check_syncs()
            gen_s = [float(p.info["gen_s"]) for p in parts]
            metrics = {**self.train_on(step, batch, t0, {**timing, "timing/gen_s": sum(gen_s)}), **sampled}
            self.data_pos = units[-1].data_pos  # what a checkpoint of this step continues from
            wall = time.perf_counter() - started
            metrics.update(self._async_metrics(step, parts, waited, sum(gen_s), wall))
            yield step, metrics

    def _take_unit(self, stream, total: int, extra: bool) -> InFlight:
        """The queue's next unit; an `extra` one (replacing filtered groups) first lets the queue run one unit
        further ahead, outside the staleness bound."""
        if extra:
            self.extra_units += 1
            self._submit_ahead(stream, total)
        return self.queue.popleft()

    def _submit_ahead(self, stream, total: int) -> None:
        """Submit units while they stay within verl's staleness bound (and the run's steps)."""
        R = self.units_per_step
        # Units replacing filtered groups (extra_units) do not count against the bound.
        while (counted := self.next_unit - self.extra_units) < total * R and counted < self.pushed_version * R + self.max_units:
            step, k = divmod(self.next_unit, R)
            if k == 0:
                self._step_items, self._step_pos = next(stream), self.data_pos
            items = self._step_items[k * self.unit_size:(k + 1) * self.unit_size]
            prompts = prompt_batch(items)
            # The prompts' indices in the step's batch: the sampling seed of each follows from it.
            prompts.set("prompt_index", torch.arange(k * self.unit_size, k * self.unit_size + len(items)))
            call = self.rollout_wg.submit("rollout", "generate", prompts, sampling_params(self.cfg, step + 1))
            self.queue.append(InFlight(step + 1, self._step_pos, call))
            self.next_unit += 1

    def _async_metrics(self, step: int, units: list[Batch], waited: float, busy: float,
                       wall: float) -> dict[str, float]:
        version = step - 1
        oldest = torch.cat([u["policy_version"] for u in units]).double()
        newest = torch.cat([u["policy_version_max"] for u in units]).double()
        unit_staleness = torch.tensor([version - float(u["policy_version"].min()) for u in units])
        self.totals["trainer_idle_s"] += waited
        self.totals["rollout_busy_s"] += busy
        return {
            "async/policy_version": float(version),
            "async/staleness_mean": float((version - oldest).mean()),
            "async/staleness_max": float((version - oldest).max()),
            "async/unit_staleness_mean": float(unit_staleness.mean()),
            "async/unit_staleness_max": float(unit_staleness.max()),
            "async/version_span_max": float((newest - oldest).max()),
            "async/partial_fraction": float((newest > oldest).double().mean()),
            "async/queue_depth": float(len(self.queue)),
            "async/trainer_idle_s": waited,
            "async/rollout_busy_s": busy,
            "async/rollout_idle_s": max(0.0, wall - self.totals["rollout_busy_s"]),
            "async/trainer_idle_ratio": self.totals["trainer_idle_s"] / max(wall, 1e-9),
            "async/rollout_idle_ratio": max(0.0, 1.0 - self.totals["rollout_busy_s"] / max(wall, 1e-9)),
        }
