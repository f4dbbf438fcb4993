"""The driver's side of off-policy training: where the loss's old logprobs come from and the rollout
correction between the engine that sampled and the trainer (docs/async.md).

    async_training.use_rollout_log_probs  compute_prox_log_prob   old logprobs of the PPO loss
    false (default)                       false                   recomputed by the trainer (proximal policy)
    true                                  false                   the rollout engine's (behaviour policy)
    true                                  true                    recomputed (proximal), weighted by
                                                                  pi_prox / pi_rollout (decoupled PPO)

The correction (algorithm.rollout_correction.*) is computed here on the whole batch, after the
advantages: the actor's copy of the batch gets `rollout_is_weights` and a response mask without the
rejected tokens. Advantages, the critic and the batch metrics see every sample. With
`algorithm.rollout_correction.bypass_mode=true` (verl's two-policy mode) the rollout logprobs are the old
logprobs and the correction runs inside the policy loss instead (rlsp/algos/bypass.py).
"""

from __future__ import annotations

from typing import Any

from rlsp.algos.rollout_correction import RolloutCorrection, compute_rollout_correction
from rlsp.algos.rollout_rs import parse_rs_options, parse_rs_thresholds
from rlsp.config.run_spec import rs_threshold
from rlsp.data.batch import Batch


def rollout_correction_settings(cfg: Any) -> RolloutCorrection:
    """The driver's correction; none under bypass_mode, whose loss corrects per micro-batch (rlsp/algos/bypass.py)."""
    return RolloutCorrection() if cfg.algorithm.rollout_correction.bypass_mode else configured_correction(cfg)


def configured_correction(cfg: Any) -> RolloutCorrection:
    """The correction `algorithm.rollout_correction.*` configures, wherever it runs."""
    rc = cfg.algorithm.rollout_correction
    return RolloutCorrection(rollout_is=rc.rollout_is, rollout_is_threshold=float(rc.rollout_is_threshold),
                             rollout_is_batch_normalize=bool(rc.rollout_is_batch_normalize), rollout_rs=rc.rollout_rs,
                             rollout_rs_threshold=rs_threshold(rc))


def check_rollout_correction_names(cfg: Any, errors: list[str]) -> None:
    """Rejection options and thresholds parse (names from the registry), collected into `errors` (bypass_mode's
    combinations are a config-stage check, rlsp.config.validate_bypass)."""
    settings = configured_correction(cfg)
    if settings.rollout_rs is None:
        return
    try:
        parse_rs_thresholds(parse_rs_options(settings.rollout_rs), settings.rollout_rs_threshold)
    except ValueError as exc:
        errors.append(str(exc))


def uses_rollout_logprobs(cfg: Any) -> bool:
    """The rollout engine's logprobs are the old logprobs (no trainer pass): async_training's bypass, or
    algorithm.rollout_correction.bypass_mode."""
    a = cfg.async_training
    return bool(a.use_rollout_log_probs and not a.compute_prox_log_prob) or bool(cfg.algorithm.rollout_correction.bypass_mode)


def reuses_update_logprobs(cfg: Any, step: int, correction: RolloutCorrection, *, distilling: bool) -> bool:
    """On-policy update (one epoch over one mini-batch, no KL in the reward): the old logprobs are the actor's own
    forward in the update, so the separate pass is skipped (as TRL does)."""
    a = cfg.actor_rollout_ref.actor
    return bool(a.reuse_update_logprobs and a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.data.train_batch_size
                and not cfg.algorithm.use_kl_in_reward and step > cfg.trainer.critic_warmup
                and not correction.enabled and not distilling  # correction, distillation: on the driver
                and not a.calculate_sum_pi_squared)  # the optimal token baseline reads it from the separate pass


def correction_reads(settings: RolloutCorrection) -> tuple[str, ...]:
    """The columns `apply_rollout_correction` reads of the batch (none when the correction is off)."""
    return ("old_logprobs", "rollout_logprobs", "response_mask") if settings.enabled else ()


def apply_rollout_correction(batch: Batch, settings: RolloutCorrection) -> tuple[Batch, dict[str, float]]:
    """(the actor's batch, rollout_corr/* metrics); `batch` itself is left as it is."""
    if not settings.enabled:
        return batch, {}
    weights, mask, metrics = compute_rollout_correction(batch["old_logprobs"], batch["rollout_logprobs"],
                                                        batch["response_mask"], settings)
    actor_batch = batch.copy()
    actor_batch.set("response_mask", mask)
    if weights is not None:
        actor_batch.set("rollout_is_weights", weights.to(batch["response_mask"].dtype))
    return actor_batch, metrics
