"""Start-up range checks of the covariance losses' keys (`actor_rollout_ref.actor.policy_loss.clip_cov_*`,
`kl_cov_ratio`, `ppo_kl_coef`; rlsp/algos/clip_cov.py, kl_cov.py). No torch import here.

Checked whatever the loss: a key off its default for another loss is refused by the POLICY_LOSS_KEYS check,
and the defaults (verl's) are in range, so an out-of-range value is always a mistake.
"""

from __future__ import annotations

from typing import Any

PL = "actor_rollout_ref.actor.policy_loss."


def check_cov_settings(actor: Any, errors: list[str]) -> None:
    """Shares in (0, 1], a non-empty covariance window, a non-negative penalty; collected into `errors`."""
    pl = actor.policy_loss
    for key, what in (("clip_cov_ratio", "share of tokens whose gradient clip_cov cuts"),
                      ("kl_cov_ratio", "share of tokens kl_cov penalises")):
        if not 0.0 < pl[key] <= 1.0:
            errors.append(f"{PL}{key}={pl[key]} must be in (0, 1] (the {what})")
    if not pl.clip_cov_lb < pl.clip_cov_ub:
        errors.append(f"{PL}clip_cov_lb={pl.clip_cov_lb} must be < {PL}clip_cov_ub={pl.clip_cov_ub} (the covariance "
                      "window clip_cov draws tokens from)")
    if not pl.ppo_kl_coef >= 0.0:
        errors.append(f"{PL}ppo_kl_coef={pl.ppo_kl_coef} must be >= 0 (kl_cov's penalty weight)")
