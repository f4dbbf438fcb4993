"""The driver's side of off-policy training: where the loss's old logprobs come from and the rollout
correction between the engine that sampled and the trainer (docs/async.md).

    async_training.use_rollout_log_probs  compute_prox_log_prob   old logprobs of the PPO loss
    false (default)                       false                   recomputed by the trainer (proximal policy)
    true                                  false                   the rollout engine's (behaviour policy)
    true                                  true                    recomputed (proximal), weighted by
                                                                  pi_prox / pi_rollout (decoupled PPO)

The correction (algorithm.rollout_correction.*) is computed here on the whole batch, after the
advantages: the actor's copy of the batch gets `rollout_is_weights` and a response mask without the
rejected tokens. Advantages, the critic and the batch metrics see every sample.
"""

from __future__ import annotations

from typing import Any

from rlsp.algos.rollout_correction import RolloutCorrection, compute_rollout_correction
from rlsp.algos.rollout_rs import parse_rs_options, parse_rs_thresholds
from rlsp.data.batch import Batch


def rollout_correction_settings(cfg: Any) -> RolloutCorrection:
    rc = cfg.algorithm.rollout_correction
    threshold = rc.rollout_rs_threshold
    return RolloutCorrection(rollout_is=rc.rollout_is, rollout_is_threshold=float(rc.rollout_is_threshold),
                             rollout_is_batch_normalize=bool(rc.rollout_is_batch_normalize), rollout_rs=rc.rollout_rs,
                             rollout_rs_threshold=threshold if isinstance(threshold, (int, float, type(None))) else str(threshold))


def check_rollout_correction_names(cfg: Any, errors: list[str]) -> None:
    """Rejection options and thresholds parse (names from the registry); collected into `errors`."""
    settings = rollout_correction_settings(cfg)
    if settings.rollout_rs is None:
        return
    try:
        parse_rs_thresholds(parse_rs_options(settings.rollout_rs), settings.rollout_rs_threshold)
    except ValueError as exc:
        errors.append(str(exc))


def uses_rollout_logprobs(cfg: Any) -> bool:
    """The rollout engine's logprobs are the old logprobs (no trainer pass)."""
    a = cfg.async_training
    return bool(a.use_rollout_log_probs and not a.compute_prox_log_prob)


def apply_rollout_correction(batch: Batch, settings: RolloutCorrection) -> tuple[Batch, dict[str, float]]:
    """(the actor's batch, rollout_corr/* metrics); `batch` itself is left as it is."""
    if not settings.enabled:
        return batch, {}
    weights, mask, metrics = compute_rollout_correction(batch["old_logprobs"], batch["rollout_logprobs"],
                                                        batch["response_mask"], settings)
    actor_batch = Batch(batch.tensors.clone(recurse=False), dict(batch.meta), dict(batch.info))
    actor_batch.set("response_mask", mask)
    if weights is not None:
        actor_batch.set("rollout_is_weights", weights.to(batch["response_mask"].dtype))
    return actor_batch, metrics
