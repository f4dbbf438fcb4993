"""The driver's side of off-policy training: where the loss's old logprobs come from and the rollout
correction between the engine that sampled and the trainer (docs/async.md).

    async_training.use_rollout_log_probs  compute_prox_log_prob   old logprobs of the PPO loss
    false (default)                       false                   recomputed by the trainer (proximal policy)
    true                                  false                   the rollout engine's (behaviour policy)
    true                                  true                    recomputed (proximal), weighted by
                                                                  pi_prox / pi_rollout (decoupled PPO)

The correction (algorithm.rollout_correction.*) runs once a step on the policy workers, each data-parallel rank
on its shard of the rows, after the old logprobs and before the advantages (`correct_rollout`,
rlsp.workers.stage_correction): the weights `rollout_is_weights` and the mask without the rejected tokens stay
there as columns of the step, and the driver receives a fixed number of values per row, from which it builds
the rollout_corr/* metrics of the whole batch. The optimal token baselines read the weights in the step stage;
the actor's update reads the rejection mask as its response mask (`actor_batch`). Advantages, the critic and the
batch metrics see every sample. With
`algorithm.rollout_correction.bypass_mode=true` (verl's two-policy mode) the rollout logprobs are the old
logprobs and the correction runs inside the policy loss instead (rlsp/algos/bypass.py).
"""

from __future__ import annotations

from typing import Any

from rlsp.algos.registry import estimator_uses
from rlsp.algos.rollout_correction import RolloutCorrection, correction_metrics
from rlsp.algos.rollout_rs import parse_rs_options, parse_rs_thresholds
from rlsp.config.run_spec import rs_threshold
from rlsp.workers.stage_correction import ACTOR_MASK, reported_stats


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
                and not correction.enabled and not distilling  # both read the old logprobs before the update
                and not a.calculate_sum_pi_squared)  # the optimal token baseline reads it from the separate pass


def reads_is_weights(cfg: Any) -> bool:
    """Whether the advantage estimator reads the rollout-correction importance weights (the optimal token
    baselines with algorithm.rollout_correction.rollout_is set)."""
    return ("rollout_is_weights_BR" in estimator_uses(cfg.algorithm.adv_estimator)
            and rollout_correction_settings(cfg).rollout_is is not None)


def correction_due(cfg: Any, settings: RolloutCorrection, step: int) -> bool:
    """Whether step `step` runs the correction: it is on, and the actor updates (after the critic warm-up) or the
    estimator reads its weights."""
    return settings.enabled and (step > cfg.trainer.critic_warmup or reads_is_weights(cfg))


def correct_rollout(wg: Any, batch: Any, settings: RolloutCorrection) -> dict[str, float]:
    """The correction of `batch` on `wg`'s policy workers (rlsp.workers.stage_correction): its columns join the
    step's (they stay on the workers); the rollout_corr/* metrics of the whole batch, from the rows' reports."""
    batch.update(wg.call("actor", "compute_rollout_correction", batch, settings))
    return correction_metrics(reported_stats(batch), settings)


def actor_batch(batch: Any, settings: RolloutCorrection) -> Any:
    """The rows the actor's update reads: with rejection (rollout_rs) a view of `batch` whose response mask is the
    workers' mask without the rejected tokens (an alias: nothing moves); `batch` itself is left as it is."""
    if settings.rollout_rs is None:
        return batch
    rows = batch.copy()
    rows.alias("response_mask", ACTOR_MASK)
    return rows
