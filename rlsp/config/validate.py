"""Start-up validation of a config: every check runs in the driver before any worker starts.

Checks here are arithmetic on config values only; checks that need the model or the registries
(head counts, estimator names) live in rlsp/trainer/preflight.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelLayout:
    """How the training world is split: world = dp * sp; rollout uses all `world` workers as dp."""

    world_size: int
    sp_size: int

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _require(cond: bool, msg: str, errors: list[str]) -> None:
    if not cond:
        errors.append(msg)


def _check_parallel(cfg: Any, errors: list[str]) -> ParallelLayout | None:
    t = cfg.trainer
    world = t.nnodes * t.n_gpus_per_node
    if t.nnodes < 1 or t.n_gpus_per_node < 1:
        errors.append(f"trainer.nnodes={t.nnodes} and trainer.n_gpus_per_node={t.n_gpus_per_node} must be >= 1")
        return None
    sp = cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    if sp < 1 or world % sp != 0:
        errors.append(
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} does not divide the "
            f"{world} training workers (nnodes*n_gpus_per_node); legal values: {_divisors(world)}"
        )
        return None
    return ParallelLayout(world_size=world, sp_size=sp)


def _check_batches(cfg: Any, layout: ParallelLayout, errors: list[str]) -> None:
    d, actor, n = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    _require(d.train_batch_size >= 1, f"data.train_batch_size={d.train_batch_size} must be >= 1", errors)
    _require(n >= 1, f"actor_rollout_ref.rollout.n={n} must be >= 1", errors)
    _require(
        d.train_batch_size % layout.world_size == 0,
        f"data.train_batch_size={d.train_batch_size} must be divisible by the {layout.world_size} "
        f"workers (prompts are split across all workers for generation)",
        errors,
    )
    mini = actor.ppo_mini_batch_size
    _require(
        mini >= 1 and d.train_batch_size % mini == 0,
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} must divide data.train_batch_size="
        f"{d.train_batch_size}; legal values: {_divisors(d.train_batch_size)}",
        errors,
    )
    _require(
        mini >= 1 and (mini * n) % layout.dp_size == 0,
        f"ppo_mini_batch_size*rollout.n={mini * n} samples must split evenly over dp={layout.dp_size} ranks",
        errors,
    )
    for key, val in (
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs),
        ("data.max_prompt_length", d.max_prompt_length),
        ("data.max_response_length", d.max_response_length),
    ):
        _require(val >= 1, f"{key}={val} must be >= 1", errors)


def _check_choices(cfg: Any, errors: list[str]) -> None:
    arr = cfg.actor_rollout_ref
    choices = (
        ("trainer.device", cfg.trainer.device, ("auto", "cpu", "cuda")),
        ("actor_rollout_ref.rollout.name", arr.rollout.name, ("vllm", "hf")),
        ("actor_rollout_ref.model.dtype", arr.model.dtype, ("float32", "bfloat16", "float16")),
        ("actor_rollout_ref.rollout.dtype", arr.rollout.dtype, ("float32", "bfloat16", "float16")),
        ("actor_rollout_ref.actor.strategy", arr.actor.strategy, ("fsdp2", "fsdp")),
        ("actor_rollout_ref.actor.loss_agg_mode", arr.actor.loss_agg_mode, ("token-mean",)),
    )
    for key, val, legal in choices:
        _require(val in legal, f"{key}={val!r} is not supported; legal values: {list(legal)}", errors)
    for bad in sorted(set(cfg.trainer.logger) - {"console", "jsonl"}):
        errors.append(f"trainer.logger contains {bad!r}; legal entries: ['console', 'jsonl']")


def _check_ranges(cfg: Any, errors: list[str]) -> None:
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    for key, val in (
        ("actor_rollout_ref.actor.clip_ratio", actor.clip_ratio),
        ("actor_rollout_ref.actor.clip_ratio_low", actor.clip_ratio_low),
        ("actor_rollout_ref.actor.clip_ratio_high", actor.clip_ratio_high),
    ):
        _require(val is None or 0.0 < val < 1.0, f"{key}={val} must be in (0, 1)", errors)
    _require(actor.clip_ratio_c > 1.0, f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1", errors)
    _require(rollout.temperature > 0.0, f"actor_rollout_ref.rollout.temperature={rollout.temperature} must be > 0", errors)
    _require(0.0 < rollout.top_p <= 1.0, f"actor_rollout_ref.rollout.top_p={rollout.top_p} must be in (0, 1]", errors)
    _require(actor.optim.lr > 0.0, f"actor_rollout_ref.actor.optim.lr={actor.optim.lr} must be > 0", errors)
    _require(cfg.trainer.total_training_steps >= 1, f"trainer.total_training_steps={cfg.trainer.total_training_steps} must be >= 1", errors)
    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and rollout.n < 2:
        errors.append(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} compares samples of one prompt: "
            f"actor_rollout_ref.rollout.n={rollout.n} must be >= 2"
        )


def validate_config(cfg: Any) -> ParallelLayout:
    """Check `cfg` (RLSPConfig or an OmegaConf view of it); raise one ValueError listing every problem."""
    errors: list[str] = []
    layout = _check_parallel(cfg, errors)
    if layout is not None:
        _check_batches(cfg, layout, errors)
    _check_choices(cfg, errors)
    _check_ranges(cfg, errors)
    if errors:
        raise ValueError("invalid rlsp config:\n  - " + "\n  - ".join(errors))
    assert layout is not None
    return layout
