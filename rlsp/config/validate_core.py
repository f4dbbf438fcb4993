"""The core config checks (batch split, critic, algorithm, legal choices, ranges): arithmetic on config
values only, registered in rlsp.config.checks (stage "config") and run by `validate_config`. Checks that
need the model or the registries (head counts, estimator names) are the preflight stage
(rlsp/checks/preflight.py).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlsp.config.choices import (
    DEVICES,
    DTYPE_NAMES,
    KL_CTRL_TYPES,
    KL_ESTIMATOR_NAMES,
    LOGGERS,
    LOSS_AGG_MODES,
    RESUME_MODES,
    REWARD_ON_ERROR,
    ROLLOUT_ENGINES,
    choice_error,
)
from rlsp.config.layout import CRITIC_ESTIMATORS, ParallelLayout
from rlsp.config.validate_cov import check_cov_settings
from rlsp.config.validate_policy_loss import check_policy_loss_keys
from rlsp.utils.divisors import divisors

# Estimators whose baseline or credit comes from the other samples of the same prompt. With rollout.n=1 every
# group is one sample; verl defines each one's result for such a group (rlsp's estimators compute the same): no
# baseline, the raw score is the advantage (SINGLETON_ADVANTAGE says how). verl's grpo_passk raises on a group of
# one, and verl's rloo_vectorized gives it advantage 0 where rlsp's alias runs rloo (raw score): both need n >= 2.
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg", "gdpo",
                    "optimal_token_baseline", "tir_optimal_token_baseline")
SINGLETON_ADVANTAGE = {
    "grpo": "its raw score (group mean 0, std 1: score / (1 + eps), or the score with norm_adv_by_std_in_grpo=false)",
    "grpo_vectorized": "its raw score (group mean 0, std 1: score / (1 + eps))",
    "rloo": "its raw score (no other sample to leave out: baseline 0)",
    "opo": "its raw score (baseline 0)",
    "gpg": "its raw score times the batch factor alpha (group mean 0)",
    "gdpo": "each reward component's raw value (group mean 0, std 1), summed and whitened over the batch",
    "optimal_token_baseline": "its raw return to go (baseline 0)",
    "tir_optimal_token_baseline": "its raw return to go (baseline 0)",
}
SINGLETON_REFUSED = {
    "grpo_passk": "pass@k compares the best sample of a group with the second best (verl raises on a group of one)",
    "rloo_vectorized": "verl's rloo_vectorized gives a group of one advantage 0 (no signal) while rlsp's alias runs "
                       "rloo, whose advantage is then the raw score; use algorithm.adv_estimator=rloo for verl's rloo",
}


def _require(cond: bool, msg: str, errors: list[str]) -> None:
    if not cond:
        errors.append(msg)


def check_adaptive(cfg: Any, layout: ParallelLayout, errors: list[str]) -> None:
    """Adaptive sequence parallelism sizes micro-batches by tokens: the role's token budget must be on."""
    arr = cfg.actor_rollout_ref
    needs = {"actor": ("actor_rollout_ref.actor.use_dynamic_bsz", arr.actor.use_dynamic_bsz),
             "ref": ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", arr.ref.log_prob_use_dynamic_bsz),
             "critic": ("critic.use_dynamic_bsz", cfg.critic.use_dynamic_bsz)}
    for role, (key, on) in needs.items():
        if (role != "critic" or layout.has_critic) and layout.role(role).adaptive and not on:
            errors.append(f"{role} has sequence_parallel_adaptive=true, which picks each micro-batch's Ulysses "
                          f"degree from its token budget: set {key}=true")


def check_batches(cfg: Any, layout: ParallelLayout, errors: list[str]) -> None:
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
        f"{d.train_batch_size}; legal values: {divisors(d.train_batch_size)}",
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
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu),
        ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu),
        ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
         cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu),
        ("data.max_prompt_length", d.max_prompt_length),
        ("data.max_response_length", d.max_response_length),
    ):
        _require(val >= 1, f"{key}={val} must be >= 1", errors)


def check_critic(cfg: Any, layout: ParallelLayout, errors: list[str]) -> None:
    if layout.critic is None:
        return
    c, n, batch = cfg.critic, cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size
    dp = layout.critic.dp_size
    _require((batch * n) % dp == 0, f"data.train_batch_size*rollout.n={batch * n} samples must split evenly over "
             f"the critic's dp={dp} ranks", errors)
    _require(c.ppo_mini_batch_size >= 1 and batch % c.ppo_mini_batch_size == 0,
             f"critic.ppo_mini_batch_size={c.ppo_mini_batch_size} must divide data.train_batch_size={batch}; "
             f"legal values: {divisors(batch)}", errors)
    _require(c.ppo_mini_batch_size >= 1 and (c.ppo_mini_batch_size * n) % dp == 0,
             f"critic.ppo_mini_batch_size*rollout.n={c.ppo_mini_batch_size * n} samples must split evenly over "
             f"the critic's dp={dp} ranks", errors)
    for key, val in (("critic.ppo_micro_batch_size_per_gpu", c.ppo_micro_batch_size_per_gpu),
                     ("critic.forward_micro_batch_size_per_gpu", c.forward_micro_batch_size_per_gpu),
                     ("critic.ppo_epochs", c.ppo_epochs),
                     ("critic.ppo_max_token_len_per_gpu", c.ppo_max_token_len_per_gpu),
                     ("critic.forward_max_token_len_per_gpu", c.forward_max_token_len_per_gpu)):
        _require(val >= 1, f"{key}={val} must be >= 1", errors)
    _require(c.cliprange_value > 0.0, f"critic.cliprange_value={c.cliprange_value} must be > 0", errors)
    _require(c.optim.lr > 0.0, f"critic.optim.lr={c.optim.lr} must be > 0", errors)
    _require(c.model.dtype in (None, *DTYPE_NAMES), f"critic.model.dtype={c.model.dtype!r} is not supported; legal "
             f"values: {[None, *DTYPE_NAMES]}", errors)


def check_algorithm(cfg: Any, errors: list[str]) -> None:
    alg = cfg.algorithm
    check_policy_loss_keys(cfg.actor_rollout_ref.actor, errors)
    check_cov_settings(cfg.actor_rollout_ref.actor, errors)
    _require(0.0 <= alg.gamma <= 1.0, f"algorithm.gamma={alg.gamma} must be in [0, 1]", errors)
    _require(0.0 <= alg.lam <= 1.0, f"algorithm.lam={alg.lam} must be in [0, 1]", errors)
    k = alg.kl_ctrl
    _require(k.kl_coef >= 0.0, f"algorithm.kl_ctrl.kl_coef={k.kl_coef} must be >= 0", errors)
    if k.type == "adaptive":
        _require(k.target_kl > 0.0, f"algorithm.kl_ctrl.target_kl={k.target_kl} must be > 0", errors)
        _require(k.horizon >= 1, f"algorithm.kl_ctrl.horizon={k.horizon} must be >= 1", errors)
    warmup = cfg.trainer.critic_warmup
    _require(warmup >= 0, f"trainer.critic_warmup={warmup} must be >= 0", errors)
    if warmup > 0 and alg.adv_estimator not in CRITIC_ESTIMATORS:
        errors.append(f"trainer.critic_warmup={warmup} needs a critic, but algorithm.adv_estimator="
                      f"{alg.adv_estimator!r} does not use one (critic estimators: {list(CRITIC_ESTIMATORS)})")


def check_choices(cfg: Any, errors: list[str]) -> None:
    arr = cfg.actor_rollout_ref
    choices = (
        ("trainer.device", cfg.trainer.device, DEVICES),
        ("actor_rollout_ref.rollout.name", arr.rollout.name, ROLLOUT_ENGINES),
        ("actor_rollout_ref.model.dtype", arr.model.dtype, DTYPE_NAMES),
        ("actor_rollout_ref.rollout.dtype", arr.rollout.dtype, DTYPE_NAMES),
        ("actor_rollout_ref.actor.loss_agg_mode", arr.actor.loss_agg_mode, LOSS_AGG_MODES),
        # Both KL keys take the same estimator names (rlsp.algos.kl implements exactly these).
        ("actor_rollout_ref.actor.kl_loss_type", arr.actor.kl_loss_type, KL_ESTIMATOR_NAMES),
        ("algorithm.kl_penalty", cfg.algorithm.kl_penalty, KL_ESTIMATOR_NAMES),
        ("algorithm.kl_ctrl.type", cfg.algorithm.kl_ctrl.type, KL_CTRL_TYPES),
        ("trainer.resume_mode", cfg.trainer.resume_mode, RESUME_MODES),
        ("reward.on_error", cfg.reward.on_error, REWARD_ON_ERROR),
    )
    if not (isinstance(cfg, DictConfig) and OmegaConf.is_interpolation(cfg.critic, "loss_agg_mode")):  # set: check it
        choices += (("critic.loss_agg_mode", cfg.critic.loss_agg_mode, LOSS_AGG_MODES),)
    for key, val, legal in choices:
        error = choice_error(key, val, legal)
        if error:
            errors.append(error)
    for bad in sorted(set(cfg.trainer.logger) - set(LOGGERS)):
        errors.append(f"trainer.logger contains {bad!r}; legal entries: {list(LOGGERS)}")


def check_ranges(cfg: Any, errors: list[str]) -> None:
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    for key, val in (
        ("actor_rollout_ref.actor.clip_ratio", actor.clip_ratio),
        ("actor_rollout_ref.actor.clip_ratio_low", actor.clip_ratio_low),
        ("actor_rollout_ref.actor.clip_ratio_high", actor.clip_ratio_high),
    ):
        # CISPO clips only the importance weight, from below at 1 - clip_ratio_low: a value >= 1 drops that bound
        # (verl's CISPO example sets clip_ratio_low=10, as the paper leaves the weight unbounded below).
        unbounded = key.endswith("_low") and actor.policy_loss.loss_mode == "cispo"
        _require(val is None or 0.0 < val < 1.0 or (unbounded and val >= 1.0),
                 f"{key}={val} must be in (0, 1)" + (" (or >= 1 with cispo: no lower bound)" if unbounded else ""),
                 errors)
    scale = actor.loss_scale_factor
    _require(scale is None or scale > 0, f"actor_rollout_ref.actor.loss_scale_factor={scale} must be > 0 (or null: "
             "data.max_response_length)", errors)
    _require(actor.clip_ratio_c > 1.0, f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1", errors)
    _require(rollout.temperature > 0.0, f"actor_rollout_ref.rollout.temperature={rollout.temperature} must be > 0", errors)
    _require(0.0 < rollout.top_p <= 1.0, f"actor_rollout_ref.rollout.top_p={rollout.top_p} must be in (0, 1]", errors)
    _require(actor.optim.lr > 0.0, f"actor_rollout_ref.actor.optim.lr={actor.optim.lr} must be > 0", errors)
    if rollout.ignore_eos and rollout.name != "vllm":
        errors.append(f"actor_rollout_ref.rollout.ignore_eos=true needs actor_rollout_ref.rollout.name=vllm "
                      f"(got {rollout.name!r}: transformers generate stops at EOS)")
    estimator = cfg.algorithm.adv_estimator
    if estimator in SINGLETON_REFUSED and rollout.n < 2:
        errors.append(f"algorithm.adv_estimator={estimator!r} compares samples of one prompt: "
                      f"actor_rollout_ref.rollout.n={rollout.n} must be >= 2 ({SINGLETON_REFUSED[estimator]})")

