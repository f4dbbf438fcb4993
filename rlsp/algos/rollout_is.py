"""Truncated importance weights between the trainer's policy and the rollout engine's (verl's
`algorithm.rollout_correction.rollout_is`, "TIS").

The samples were drawn by the rollout engine (behaviour policy, `rollout_logprobs`); the PPO loss is
built around the trainer's recomputed `old_logprobs` (proximal policy). The weight
rho = pi_old / pi_rollout corrects for the gap (numerics, a stale engine):

    token     rho_t = exp(clamp(old_t - rollout_t, -20, 20))                     each token alone
    sequence  rho   = exp(clamp(sum_t (old_t - rollout_t), -20, 20)) on every token of the row

then truncated above at `rollout_is_threshold`, zero on padding, and with `rollout_is_batch_normalize`
divided by their mean (over tokens for "token", over rows for "sequence"; after truncation). Weights
carry no gradient: they change the measure, not the objective.

Shape legend: B rows, R response tokens.
"""

from __future__ import annotations

import torch

from rlsp.algos.aggregation import masked_mean, masked_sum
from rlsp.algos.registry import get_rollout_is, register_rollout_is

# exp() of a log-weight beyond this is inf or meaningless (verl's safety bound, ~[2e-9, 5e8]).
SAFETY_BOUND = 20.0


@register_rollout_is("token")
def token_log_weights(log_ratio_BR: torch.Tensor, mask_BR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-weights and the unclamped log-ratios (for the metrics)."""
    return log_ratio_BR.clamp(-SAFETY_BOUND, SAFETY_BOUND), log_ratio_BR


@register_rollout_is("sequence")
def sequence_log_weights(log_ratio_BR: torch.Tensor, mask_BR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One log-weight per row (sum over its tokens) on every token, and the row sums [B, 1]."""
    sum_B1 = masked_sum(log_ratio_BR, mask_BR, dim=-1).unsqueeze(-1)
    return sum_B1.clamp(-SAFETY_BOUND, SAFETY_BOUND).expand_as(log_ratio_BR), sum_B1


def compute_rollout_is_weights(
    old_logprobs_BR: torch.Tensor,
    rollout_logprobs_BR: torch.Tensor,
    mask_BR: torch.Tensor,
    level: str,
    threshold: float,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(weights_BR, metrics): truncated importance weights of `level` (see the module docstring).

    Metrics (verl's names, without the `rollout_corr/` prefix): `rollout_is_mean/max/min` of the
    weights before truncation (sequence level: max/min from the unclamped row log-ratios),
    `rollout_is_ratio_fraction_high/low` (above the threshold / below its reciprocal),
    `rollout_is_eff_sample_size` (1 / mean(w_n^2) with w clamped to [1/threshold, threshold] and
    normalised to mean 1), and `rollout_is_batch_norm_factor` when normalising.
    """
    if threshold <= 0:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold={threshold} must be > 0")
    if not bool(mask_BR.bool().any()):
        raise ValueError("rollout correction needs at least one response token; the batch has none")
    log_w_BR, log_ratio_metric = get_rollout_is(level)(old_logprobs_BR - rollout_logprobs_BR, mask_BR)
    raw_BR = torch.exp(log_w_BR) * mask_BR
    metrics = _is_metrics(raw_BR, log_ratio_metric, mask_BR, level, threshold)
    weights_BR = raw_BR.clamp(max=threshold).detach()
    if batch_normalize:
        if level == "sequence":
            valid_B = mask_BR.sum(-1) > 0
            mean = masked_mean(weights_BR, mask_BR, dim=-1)[valid_B].mean()
        else:
            mean = masked_mean(weights_BR, mask_BR)
        factor = float(mean) if float(mean) > 1e-8 else 1.0
        weights_BR = weights_BR / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights_BR, metrics


def _is_metrics(raw_BR: torch.Tensor, log_ratio: torch.Tensor, mask_BR: torch.Tensor, level: str,
                threshold: float) -> dict[str, float]:
    keep = mask_BR.bool()
    low = 1.0 / threshold
    if level == "sequence":
        valid_B = mask_BR.sum(-1) > 0
        rows = log_ratio.squeeze(-1)[valid_B]
        high_frac = float((rows > torch.log(torch.tensor(threshold, dtype=rows.dtype))).float().mean())
        low_frac = float((rows < torch.log(torch.tensor(low, dtype=rows.dtype))).float().mean())
        w_max, w_min = float(torch.exp(rows.max().clamp(max=SAFETY_BOUND))), float(torch.exp(rows.min()))
    else:
        high_frac = float(masked_mean((raw_BR > threshold).to(raw_BR.dtype), mask_BR))
        low_frac = float(masked_mean((raw_BR < low).to(raw_BR.dtype), mask_BR))
        w_max, w_min = float(raw_BR[keep].max()), float(raw_BR[keep].min())
    clamped = raw_BR.clamp(min=low, max=threshold)
    normalised = clamped / (masked_mean(clamped, mask_BR) + 1e-8)
    return {
        "rollout_is_mean": float(masked_mean(raw_BR, mask_BR)),
        "rollout_is_max": w_max,
        "rollout_is_min": w_min,
        "rollout_is_ratio_fraction_high": high_frac,
        "rollout_is_ratio_fraction_low": low_frac,
        "rollout_is_eff_sample_size": 1.0 / float(masked_mean(normalised.square(), mask_BR)),
    }
