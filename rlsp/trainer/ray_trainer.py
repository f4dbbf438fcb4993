"""RayTrainer: the RL loop on the driver. One step reads like the algorithm:

    prompts -> generate (vLLM on every worker) -> score (rule rewards) -> old logprobs (actor)
    -> ref logprobs (reference) -> advantages (estimator registry) -> update actor -> sync weights
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import AutoTokenizer

from rlsp.algos.registry import get_adv_estimator
from rlsp.controller.resource_pool import ResourcePool, default_cpus_per_worker
from rlsp.controller.worker_group import RayWorkerGroup
from rlsp.data.batch import Batch
from rlsp.data.dataset import PromptDataset, iterate_batches
from rlsp.engine.fsdp_engine import assert_sp_matches
from rlsp.trainer.metrics import MetricsLogger
from rlsp.trainer.scoring import Scorer
from rlsp.utils.device import resolve_device_type
from rlsp.utils.logging import get_logger
from rlsp.utils.timing import timed
from rlsp.workers.policy_worker import PolicyWorker

log = get_logger("rlsp.trainer")


def _prompt_batch(items: list[dict[str, Any]], uids: list[str] | None = None) -> Batch:
    return Batch.from_dict(
        {"prompt_index": torch.arange(len(items))},
        meta={
            "prompt_ids": [it["prompt_ids"] for it in items],
            "uid": uids or [uuid.uuid4().hex for _ in items],
            "data_source": [it["data_source"] for it in items],
            "ground_truth": [it["ground_truth"] for it in items],
            "extra_info": [it.get("extra_info") for it in items],
        },
    )


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp_min(1.0))


class RayTrainer:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.run_dir = cfg.trainer.default_local_dir
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
        d = cfg.data
        self.train_set = PromptDataset(d.train_files, self.tokenizer, d.max_prompt_length, d.prompt_key, d.filter_overlong_prompts)
        self.val_set = (PromptDataset(d.val_files, self.tokenizer, d.max_prompt_length, d.prompt_key, d.filter_overlong_prompts)
                        if d.val_files else None)
        if len(self.train_set) < d.train_batch_size:
            raise ValueError(f"data.train_batch_size={d.train_batch_size} exceeds the {len(self.train_set)} training prompts")
        self.scorer = Scorer(self.tokenizer, cfg.reward.custom_function_path, cfg.reward.custom_function_name)
        self.metrics = MetricsLogger(self.run_dir, list(cfg.trainer.logger))
        self.sp_size = cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size

    # ------------------------------------------------------------------ workers
    def start_workers(self) -> list[dict[str, Any]]:
        t = self.cfg.trainer
        device_type = resolve_device_type(t.device)
        world = t.nnodes * t.n_gpus_per_node
        cpus = 1 if device_type == "cuda" else default_cpus_per_worker(world)
        self.pool = ResourcePool(t.nnodes, t.n_gpus_per_node, device_type, cpus_per_worker=cpus)
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(self.cfg.actor_rollout_ref.rollout.cpu_kvcache_space_gib),
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
            "RLSP_LOG_LEVEL": os.environ.get("RLSP_LOG_LEVEL", "INFO"),
        }
        config = OmegaConf.to_container(self.cfg, resolve=True)
        self.wg = RayWorkerGroup(PolicyWorker, self.pool, config, self.sp_size, env_vars=env)
        return self.wg.init_workers()

    def shutdown(self) -> None:
        if getattr(self, "wg", None) is not None:
            self.wg.shutdown()

    # ------------------------------------------------------------------ one step
    def _sampling(self, step: int, *, validate: bool = False) -> dict[str, Any]:
        r, d = self.cfg.actor_rollout_ref.rollout, self.cfg.data
        if validate:
            return {"n": 1, "temperature": r.val_temperature, "max_tokens": d.max_response_length, "seed": 0}
        return {"n": r.n, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                "max_tokens": d.max_response_length, "seed": self.cfg.trainer.seed * 100003 + step}

    def _advantages(self, batch: Batch) -> None:
        alg = self.cfg.algorithm
        kwargs: dict[str, Any] = {}
        if alg.adv_estimator == "grpo":
            kwargs["norm_adv_by_std"] = alg.norm_adv_by_std_in_grpo
        elif alg.adv_estimator.startswith("reinforce_plus_plus"):
            kwargs["gamma"] = alg.gamma
        adv, ret = get_adv_estimator(alg.adv_estimator)(
            batch["token_level_scores"], batch["response_mask"], batch.meta["uid"], **kwargs)
        batch.set("advantages", adv)
        batch.set("returns", ret)

    def train_step(self, step: int, items: list[dict[str, Any]]) -> dict[str, float]:
        timing: dict[str, float] = {}
        t0 = time.perf_counter()
        temperature = self.cfg.actor_rollout_ref.rollout.temperature
        with timed("timing/gen_s", timing):
            batch = self.wg.dispatch_by_rank("generate", _prompt_batch(items), self._sampling(step))
        batch.info["temperature"] = temperature
        if step == 1 and self.sp_size > 1 and self.cfg.trainer.sp_self_check:
            self.check_sp(batch)
        with timed("timing/reward_s", timing):
            scores = self.scorer.score_rows(batch)
        with timed("timing/old_logprob_s", timing):
            batch.update(self.wg.dispatch_batch_by_dp("compute_old_logprobs", batch))
        if self.cfg.actor_rollout_ref.actor.use_kl_loss:
            with timed("timing/ref_s", timing):
                batch.update(self.wg.dispatch_batch_by_dp("compute_ref_logprobs", batch))
        self._advantages(batch)
        with timed("timing/update_s", timing):
            actor_metrics = self.wg.dispatch_by_dp("update_actor", batch)[0]
        with timed("timing/weight_sync_s", timing):
            self.wg.call_all("sync_weights")
        timing["timing/step_s"] = time.perf_counter() - t0
        return {**self._batch_metrics(batch, scores, timing), **actor_metrics, **timing}

    def _batch_metrics(self, batch: Batch, scores: np.ndarray, timing: dict[str, float]) -> dict[str, float]:
        mask = batch["response_mask"]
        lengths = mask.sum(-1)
        diff = (batch["rollout_logprobs"] - batch["old_logprobs"]).abs() * mask
        tokens = float(batch["attention_mask"].sum())
        return {
            "reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min()),
            "reward/accuracy": float((scores >= 1.0).mean()),
            "advantages/mean": masked_mean(batch["advantages"], mask),
            "response_length/mean": float(lengths.mean()),
            "response_length/clip_ratio": float((lengths >= mask.shape[1]).float().mean()),
            "rollout/logprob_diff": masked_mean(diff, mask), "rollout/logprob_diff_max": float(diff.max()),
            "throughput/tokens_per_s": tokens / max(timing["timing/step_s"], 1e-9),
            "throughput/response_tokens": float(mask.sum()),
        }

    def check_sp(self, batch: Batch) -> float:
        """Stop the run if the sp-sharded forward disagrees with an unsharded one on real rows."""
        tol = self.cfg.trainer.sp_self_check_tol
        worst = max(self.wg.dispatch_by_dp("sp_self_check", batch))
        assert_sp_matches(worst, tol, self.sp_size)
        log.info("sp self-check passed: max |dlogprob| = %.2e (sp=%d)", worst, self.sp_size)
        return worst

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        items = [self.val_set[i] for i in range(len(self.val_set))]
        world = self.wg.world_size
        padded = items + items[: (-len(items)) % world]
        batch = self.wg.dispatch_by_rank("generate", _prompt_batch(padded), self._sampling(0, validate=True))
        batch = batch.select_rows(slice(0, len(items)))
        scores = self.scorer.score_rows(batch)
        return {"val/accuracy": float((scores >= 1.0).mean()), "val/reward_mean": float(scores.mean()),
                "val/num_prompts": float(len(items))}

    # ------------------------------------------------------------------ loop
    def fit(self) -> list[dict[str, Any]]:
        t = self.cfg.trainer
        total = t.total_training_steps
        val_on = self.val_set is not None and t.test_freq > 0
        pending_val = self.validate() if val_on and t.val_before_train else {}
        batches = self._batch_stream()
        bar = tqdm(range(1, total + 1), desc="rlsp", unit="step", dynamic_ncols=True, disable=None)
        for step in bar:
            metrics = {**pending_val, **self.train_step(step, next(batches))}
            pending_val = {}
            if val_on and (step % t.test_freq == 0 or step == total):
                metrics.update(self.validate())
            self.metrics.log(step, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['timing/step_s']:.2f}")
        if t.save_final_model:
            saved = self.wg.call_all("save_model", os.path.abspath(os.path.join(self.run_dir, "actor_hf")))[0]
            log.info("trained actor (Hugging Face format): %s", saved)
        if t.plot:
            path = self.metrics.plot_rewards()
            log.info("reward plot: %s", path)
        log.info("metrics: %s", self.metrics.path)
        return self.metrics.history

    def _batch_stream(self):
        d = self.cfg.data
        for epoch in range(self.cfg.trainer.total_epochs):
            yield from iterate_batches(self.train_set, d.train_batch_size, d.seed, epoch)
