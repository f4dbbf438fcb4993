"""RayTrainer: the RL loop on the driver. One step reads like the algorithm:

    prompts -> generate (vLLM on every worker) -> score (rule rewards, or the reward model) -> old logprobs (actor)
    -> ref logprobs (reference) -> values (critic) -> rollout correction (off-policy) -> rewards (- KL penalty)
    -> advantages
    -> update critic -> update actor (after the critic warm-up) -> sync weights to the rollout engine

With DAPO's dynamic sampling (algorithm.filter_groups) generate -> score repeats over further prompt batches
until enough groups are informative (rlsp/step/dynamic_sampling.py); the rest of the step is unchanged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rlsp.algos.kl_ctrl import build_kl_controller
from rlsp.config.layout import ParallelLayout
from rlsp.config.run_length import resolve_total_steps
from rlsp.controller.reads import read_columns
from rlsp.controller.stopping import StopRequest, Terminated
from rlsp.controller.traffic import TRAFFIC
from rlsp.controller.training_workers import check_sharded_forwards, start_training_workers
from rlsp.controller.worker_group import RayWorkerGroup
from rlsp.controller.worker_pools import StartedPool
from rlsp.data.batch import Batch
from rlsp.engine.export import export_hf
from rlsp.run.checkpoint import CheckpointWriter, TrainerState, latest_checkpoint, read_metrics_lines
from rlsp.run.metrics import MetricsLogger
from rlsp.run.run_checkpoint import load_run, save_run
from rlsp.step.baselines import add_greedy_baselines, greedy_sampling, needs_greedy_baseline
from rlsp.step.batch_metrics import check_finite, compute_batch_metrics, row_tokens
from rlsp.step.distill import Distillation
from rlsp.step.dynamic_sampling import build_dynamic_sampler
from rlsp.step.off_policy import (
    actor_batch,
    correct_rollout,
    correction_due,
    reuses_update_logprobs,
    rollout_correction_settings,
    uses_rollout_logprobs,
)
from rlsp.step.reward import Reward, build_reward, start_rule_scorers
from rlsp.step.row_advantages import compute_row_advantages, row_level
from rlsp.step.stage_advantages import balanced_step_order, compute_token_rewards
from rlsp.trainer.progress import RunProgress
from rlsp.trainer.rollout_inputs import StepPrompts, batch_stream, load_datasets, prompt_batch, sampling_params
from rlsp.trainer.val_generations import ValGenerationLog
from rlsp.trainer.validation import run_validation
from rlsp.utils.logging import get_logger
from rlsp.utils.timing import timed

log = get_logger("rlsp.trainer")


class RayTrainer:
    def __init__(self, cfg: DictConfig, layout: ParallelLayout) -> None:
        self.cfg, self.layout = cfg, layout
        self.run_dir = cfg.trainer.default_local_dir
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
        self.train_set, self.val_set = load_datasets(cfg, self.tokenizer)
        self.distill = Distillation.build(cfg, self.tokenizer, [self.train_set, self.val_set])  # None when off
        resolve_total_steps(cfg, len(self.train_set))  # verl's rule; from here on the config holds the run length
        self.metrics = MetricsLogger(self.run_dir, list(cfg.trainer.logger))
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = build_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.correction = rollout_correction_settings(cfg)
        self.sampler = build_dynamic_sampler(cfg)  # DAPO's dynamic sampling (algorithm.filter_groups)
        self.prompts = StepPrompts()  # the step's prompt rows (every round), for ReMax's greedy pass
        self.val_log = ValGenerationLog.build(cfg, self.tokenizer)  # trainer.log_val_generations (None: off)
        self.wg: RayWorkerGroup | None = None
        self.reward: Reward | None = None  # the reward subsystem, once the workers it may use are up
        self.critic_wg: RayWorkerGroup | None = None
        self.start_step = 1
        # where start-up went (ray init, worker processes, worker set-up); logged with the first step
        self.startup: dict[str, float] = {}
        self.stop = StopRequest()  # SIGTERM with trainer.save_on_preempt: checkpoint this step, then stop
        self.data_pos = (0, 0)  # (epoch, batches of that epoch consumed)
        self.ckpt = CheckpointWriter(self.run_dir, cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep)

    # ------------------------------------------------------------------ workers
    def start_workers(self, pools: list[StartedPool] | None = None) -> list[dict[str, Any]]:
        """Start (or take `pools`, started while the checks ran: rlsp.controller.ray_session) and initialise
        the workers; each worker's init result."""
        scorers = start_rule_scorers(self.cfg)  # its processes (if any) start while the training workers do
        workers = start_training_workers(self.cfg, self.layout, pools)
        self.wg, self.critic_wg = workers.wg, workers.critic_wg
        self.reward = build_reward(self.cfg, self.layout, scorers, workers.wg, workers.reward_servers)
        self.startup.update(workers.timings)
        return workers.infos

    @property
    def rollout_wg(self) -> RayWorkerGroup:
        """The workers whose engines generate (colocated: the policy workers)."""
        return self.wg

    def sync_rollout(self, step: int) -> None:
        """The actor's weights after `step` steps into the rollout engines (colocated: each worker's own)."""
        self.wg.call_worker("sync_weights")

    def read(self, data: Batch, names: Iterable[str]) -> Batch:
        """The step's worker-held columns `names` to the driver, built by a policy worker (idle meanwhile): the
        driver reads a worker-held column only through this (rlsp.controller.reads)."""
        return read_columns(self.wg, data, names)

    def _groups(self) -> list[RayWorkerGroup]:
        return list({id(g): g for g in (self.wg, self.critic_wg) if g is not None}.values())

    def wait_outputs(self) -> None:
        """Wait for what `fit` still writes once it returned (the reward plot, drawn while the run shuts down)."""
        self.metrics.wait_plot()

    def shutdown(self, graceful: bool = True) -> None:
        if self.reward is not None:
            self.reward.shutdown()
        for wg in self._groups():
            wg.shutdown(graceful=graceful)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int) -> str:
        """Every role's sharded state, worker RNGs and the driver's state, made visible atomically."""
        state = TrainerState(step=step, epoch=self.data_pos[0], batch_in_epoch=self.data_pos[1],
                             kl_ctrl=self.kl_ctrl.state_dict(), layout=self.layout.describe())
        return save_run(self.ckpt, self.cfg, state, self.metrics.jsonl_lines(), self.wg, self.critic_wg, self._groups())

    def load_checkpoint(self, path: str) -> None:
        """Continue from `path`: weights, optimizers, schedules (resharded if the layout changed), data
        position, KL controller, metrics so far; then the rollout engines get the loaded weights."""
        state, restored = load_run(path, self.wg, self.critic_wg, self._groups())
        self.sync_rollout(state.step)
        self.kl_ctrl.load_state_dict(state.kl_ctrl)
        self.start_step, self.data_pos = state.step + 1, (state.epoch, state.batch_in_epoch)
        self.metrics.restore(read_metrics_lines(path))
        log.info("resumed from %s at step %d (written with %s; worker RNG states %s)", path, state.step,
                 state.layout, "restored" if restored else "reseeded: the layout changed")

    # ------------------------------------------------------------------ one step
    def _rewards(self, batch: Batch) -> dict[str, float]:
        """token_level_rewards = scores, minus beta * KL(old || ref) per token with use_kl_in_reward; on the
        workers, with the advantages of the estimators that run there (rlsp.step.stage_advantages)."""
        if row_level(self.cfg, batch):  # outcome advantages from per-row values (rlsp.step.row_advantages)
            return {}
        return compute_token_rewards(self.wg, batch, self.cfg, self.kl_ctrl)

    def _advantages(self, batch: Batch) -> None:
        """The outcome estimators' advantages from per-row values; the others came with the rewards (`_rewards`)."""
        if row_level(self.cfg, batch):
            compute_row_advantages(batch, self.cfg)

    def train_step(self, step: int, items: list[dict[str, Any]]) -> dict[str, float]:
        timing: dict[str, float] = {}
        t0 = time.perf_counter()
        TRAFFIC.reset()  # perf/driver_bytes: this step's traffic (not start-up's, validation's or a checkpoint's)
        self.prompts.clear()  # the prompt rows this step sends (`generate`), kept for a greedy pass
        if self.sampler is not None:  # generate more prompt batches until enough groups are informative
            generate = lambda rows, first: self.generate(step, rows, first)  # noqa: E731
            batch, sampled = self.sampler.collect(generate, self.reward, items, self._batches, timing, self.read)
            return {**self.train_on(step, batch, t0, timing), **sampled}
        with timed("timing/gen_s", timing):
            batch = self.generate(step, items)
        return self.train_on(step, batch, t0, timing)

    def generate(self, step: int, items: list[dict[str, Any]], first_index: int = 0) -> Batch:
        """Samples of `items`; a prompt's sampling seed follows from its index (first_index + position)."""
        prompts = prompt_batch(items)
        prompts.set("prompt_index", torch.arange(first_index, first_index + len(items)))
        self.prompts.add(prompts)
        return self.rollout_wg.call("rollout", "generate", prompts, sampling_params(self.cfg, step))

    def train_on(self, step: int, batch: Batch, t0: float, timing: dict[str, float]) -> dict[str, float]:
        """Everything after generation: score, logprobs, advantages, updates, weights to the engines."""
        metrics: dict[str, float] = {}
        batch.info.update(temperature=self.cfg.actor_rollout_ref.rollout.temperature, global_step=step)
        if self.cfg.trainer.balance_batch and self.layout.dp_size > 1:
            batch = batch.select_rows(balanced_step_order(self.cfg, row_tokens(batch, self.read).tolist(), batch.meta["uid"],
                                                          self.layout.dp_size))  # groups whole where the workers need it
        if step == 1 and self.cfg.trainer.sp_self_check:
            self.check_sp(batch)
        if needs_greedy_baseline(self.cfg):  # ReMax: a prompt's greedy response is its samples' baseline
            greedy = greedy_sampling(sampling_params(self.cfg, step))
            generate = lambda prompts: self.rollout_wg.call("rollout", "generate", prompts, greedy)  # noqa: E731
            metrics.update(add_greedy_baselines(generate, self.rollout_wg.world_size, self.reward, batch,
                                                self.prompts.rows(), timing))
        with timed("timing/reward_s", timing):
            # Rows collected by dynamic sampling were scored before filtering.
            scores = np.asarray(batch.meta["row_score"]) if "row_score" in batch else self.reward.score(batch)
        metrics.update(self.reward.metrics(batch))
        if uses_rollout_logprobs(self.cfg):  # the engine's logprobs are the behaviour policy of the loss
            batch.alias("old_logprobs", "rollout_logprobs")
        elif not reuses_update_logprobs(self.cfg, step, self.correction, distilling=self.distill is not None):
            with timed("timing/old_logprob_s", timing):
                batch.update(self.wg.call("actor", "compute_log_prob", batch))
        if self.layout.has_reference:
            with timed("timing/ref_s", timing):
                batch.update(self.wg.call("ref", "compute_ref_log_prob", batch))
        if self.critic_wg is not None:
            with timed("timing/values_s", timing):
                batch.update(self.critic_wg.call("critic", "compute_values", batch))
        with timed("timing/adv_s", timing):
            if correction_due(self.cfg, self.correction, step):  # once, on the workers, before the advantages
                corrected = correct_rollout(self.wg, batch, self.correction)
                metrics.update(corrected if step > self.cfg.trainer.critic_warmup else {})  # with the actor's update
            metrics.update(self._rewards(batch))
            self._advantages(batch)
        if self.distill is not None:  # the teachers' logprobs; advantages get the distillation term
            self.read(batch, [self.distill.key])  # the rows' routes to the teachers (a per-row field)
            metrics.update(self.distill.apply(self.wg, batch, timing))
        if self.critic_wg is not None:
            with timed("timing/update_critic_s", timing):
                metrics.update(self.critic_wg.call("critic", "update_critic", batch)[0])
        if step > self.cfg.trainer.critic_warmup:
            with timed("timing/update_actor_s", timing):  # with the correction's mask and weights, if any
                metrics.update(self.wg.call("actor", "update_actor", actor_batch(batch, self.correction))[0])
            with timed("timing/weight_sync_s", timing):
                self.sync_rollout(step)
        timing["timing/step_s"] = time.perf_counter() - t0
        width = self.cfg.data.max_response_length
        return {**compute_batch_metrics(batch, scores, timing["timing/step_s"], width, self.read), **metrics, **timing,
                **TRAFFIC.take()}

    def check_sp(self, batch: Batch) -> float:
        """Stop the run if a sharded forward disagrees with an unsharded one (see check_sharded_forwards)."""
        return check_sharded_forwards(self.cfg, self.layout, self.wg, self.critic_wg, batch)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        return run_validation(self.cfg, self.rollout_wg, self.reward, self.val_set, self.val_log)

    # ------------------------------------------------------------------ loop
    def fit(self) -> list[dict[str, Any]]:
        t = self.cfg.trainer
        total = t.total_training_steps
        if self.start_step > total:
            log.info("the run is already complete at step %d (trainer.total_training_steps=%d)", self.start_step - 1, total)
            return self.metrics.history
        val_on = self.val_set is not None and t.test_freq > 0
        self.metrics.open(t.project_name, t.experiment_name, OmegaConf.to_container(self.cfg, resolve=True),
                          self.start_step)
        progress, ok = RunProgress(self.run_dir, self.start_step, total), False
        try:
            pending_val = self.validate() if val_on and t.val_before_train and self.start_step == 1 else {}
            for step, step_metrics in self.run_steps(total):
                metrics = {**pending_val, **step_metrics}
                if step == self.start_step:
                    metrics.update(self.startup)
                    self.stop.armed = bool(t.save_on_preempt)  # from now on SIGTERM saves the step in flight first
                check_finite(metrics, step)
                pending_val = {}
                if val_on and (step % t.test_freq == 0 or step == total):
                    metrics.update(self.validate())
                self.metrics.log(step, metrics)
                progress.step_done(metrics)
                if (t.save_freq > 0 and step % t.save_freq == 0) or step == total or self.stop.requested:
                    progress.outputs["checkpoint"] = self.save_checkpoint(step)
                    if step != total:  # the last one is in the summary
                        log.info("checkpoint: %s", progress.outputs["checkpoint"])
                if self.stop.requested and step != total:
                    raise Terminated()
            if t.save_final_model:
                progress.outputs["model (HF)"] = export_hf(latest_checkpoint(self.run_dir),
                                                           os.path.abspath(os.path.join(self.run_dir, "actor_hf")))
            if t.plot and (plot := self.metrics.plot_rewards_in_background()):  # `wait_outputs` waits for it
                progress.outputs["reward plot"] = plot
            ok = True
        finally:
            progress.close()
            where = self.metrics.locations()
            self.metrics.close(ok)
        log.info("%s", progress.summary(self.metrics.history, where))
        return self.metrics.history

    def run_steps(self, total: int):
        """(step, metrics) of each training step from start_step to `total`: generate, then train."""
        batches = self._batches = self._batch_stream()
        for step in range(self.start_step, total + 1):
            yield step, self.train_step(step, next(batches))

    def _batch_stream(self):
        """Training batches from the current data position on; `data_pos` follows what was consumed."""
        for pos, items in batch_stream(self.train_set, self.cfg, self.data_pos, endless=self.sampler is not None):
            self.data_pos = pos
            yield items
