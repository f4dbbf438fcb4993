"""Rollout correction: importance weights and rejection masks between the rollout engine's policy
(which sampled) and the trainer's (which the PPO loss is built around), with off-policy diagnostics.

Settings are verl's `algorithm.rollout_correction.*`; the weights come from rlsp/algos/rollout_is.py,
the masks from rlsp/algos/rollout_rs.py. Metrics carry verl's names under `rollout_corr/`. With
`bypass_mode=true` the same correction runs inside the policy loss instead, per micro-batch, from the
current logprobs (rlsp/algos/bypass.py; `loss_type` picks that loss).

Shape legend: B rows, R response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlsp.algos.aggregation import masked_mean, masked_sum
from rlsp.algos.rollout_is import SAFETY_BOUND, compute_rollout_is_weights
from rlsp.algos.rollout_rs import compute_rollout_rs_mask
from rlsp.config.choices import BYPASS_LOSS_TYPES

__all__ = ["BYPASS_LOSS_TYPES", "RolloutCorrection", "compute_offpolicy_metrics", "compute_rollout_correction"]


@dataclass(frozen=True)
class RolloutCorrection:
    rollout_is: str | None = None  # None | token | sequence
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None  # comma-separated options, e.g. "token_k1,seq_max_k2"
    rollout_rs_threshold: str | float | None = None

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None


def compute_offpolicy_metrics(old_BR: torch.Tensor, rollout_BR: torch.Tensor, mask_BR: torch.Tensor) -> dict[str, float]:
    """kl = mean(rollout - old) (KL(rollout || old), sampled from rollout), k3_kl, chi2_token =
    E[rho^2] - 1, chi2_seq = E_rows[(prod rho)^2] - 1, and each policy's mean per-row perplexity."""
    log_ratio = old_BR - rollout_BR
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    row_sum = masked_sum(log_ratio, mask_BR, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "kl": float(masked_mean(-log_ratio, mask_BR)),
        "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, mask_BR)),
        "chi2_token": float(masked_mean(rho.square(), mask_BR)) - 1.0,
        "chi2_seq": float(torch.exp(2.0 * row_sum).mean()) - 1.0,
        "training_ppl": float(torch.exp(-masked_mean(old_BR, mask_BR, dim=-1)).mean()),
        "rollout_ppl": float(torch.exp(-masked_mean(rollout_BR, mask_BR, dim=-1)).mean()),
    }


def compute_rollout_correction(
    old_logprobs_BR: torch.Tensor, rollout_logprobs_BR: torch.Tensor, mask_BR: torch.Tensor,
    settings: RolloutCorrection,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(is_weights_BR or None, mask_BR after rejection, metrics under `rollout_corr/`).

    The weights are computed on every token of `mask_BR` and rejection only zeroes the mask: a
    rejected token keeps its weight, but leaves the loss through the mask (as in verl)."""
    if old_logprobs_BR.shape != rollout_logprobs_BR.shape or old_logprobs_BR.shape != mask_BR.shape:
        raise ValueError(f"old {tuple(old_logprobs_BR.shape)}, rollout {tuple(rollout_logprobs_BR.shape)} and mask "
                         f"{tuple(mask_BR.shape)} logprobs must have one shape")
    metrics: dict[str, float] = {}
    weights_BR = None
    if settings.rollout_is is not None:
        weights_BR, is_metrics = compute_rollout_is_weights(
            old_logprobs_BR, rollout_logprobs_BR, mask_BR, settings.rollout_is, settings.rollout_is_threshold,
            settings.rollout_is_batch_normalize)
        metrics.update(is_metrics)
    new_mask_BR = mask_BR
    if settings.rollout_rs is not None:
        new_mask_BR, rs_metrics = compute_rollout_rs_mask(old_logprobs_BR, rollout_logprobs_BR, mask_BR,
                                                          settings.rollout_rs, settings.rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_logprobs_BR, rollout_logprobs_BR, mask_BR))
    return weights_BR, new_mask_BR, {f"rollout_corr/{k}": v for k, v in metrics.items()}
