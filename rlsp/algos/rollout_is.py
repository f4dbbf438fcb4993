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

On a shard of the batch's rows (the policy workers, rlsp.workers.stage_correction) the weights come from
`truncated_is_weights` with a `reduce` for the normalisation's batch-wide sum, and the metrics from the
per-row values of `is_row_stats`, gathered over every row (`is_metrics`): the whole-batch
`compute_rollout_is_weights` is the same two steps on one process.

Shape legend: B rows, R response tokens.
"""

from __future__ import annotations

import torch

from rlsp.algos.aggregation import masked_sum
from rlsp.algos.registry import get_rollout_is, register_rollout_is
from rlsp.algos.whiten import Reduce

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


def truncated_is_weights(
    old_logprobs_BR: torch.Tensor,
    rollout_logprobs_BR: torch.Tensor,
    mask_BR: torch.Tensor,
    level: str,
    threshold: float,
    batch_normalize: bool = False,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, float | None]:
    """(weights_BR, the batch-normalisation factor or None) of `level` (see the module docstring). The factor's
    statistic is a sum over rows (`norm_sums`): `reduce` sums it over the shards holding the batch (None: these
    rows are the whole batch)."""
    if threshold <= 0:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold={threshold} must be > 0")
    log_w_BR, _ = get_rollout_is(level)(old_logprobs_BR - rollout_logprobs_BR, mask_BR)
    weights_BR = (torch.exp(log_w_BR) * mask_BR).clamp(max=threshold).detach()
    if not batch_normalize:
        return weights_BR, None
    sums = norm_sums(mask_BR.sum(-1), masked_sum(weights_BR, mask_BR, dim=-1), level)
    factor = norm_factor(sums if reduce is None else reduce(sums))
    return weights_BR / factor, factor


def norm_sums(tokens_B: torch.Tensor, truncated_sum_B: torch.Tensor, level: str) -> torch.Tensor:
    """[2] float64 (numerator, count) of the batch-normalisation mean over these rows: the truncated weights'
    sum and the token count ("token"), or the rows' mean weights and the rows with tokens ("sequence")."""
    tokens_B, truncated_sum_B = tokens_B.double(), truncated_sum_B.double()
    if level == "sequence":
        valid_B = tokens_B > 0
        return torch.stack([(truncated_sum_B / tokens_B.clamp_min(1.0))[valid_B].sum(), valid_B.double().sum()])
    return torch.stack([truncated_sum_B.sum(), tokens_B.sum()])


def norm_factor(sums: torch.Tensor) -> float:
    """The batch mean of `norm_sums` (summed over every row of the batch), floored to 1 when it is ~0."""
    mean = float(sums[0] / sums[1].clamp_min(1.0))
    return mean if mean > 1e-8 else 1.0


def is_row_stats(old_logprobs_BR: torch.Tensor, rollout_logprobs_BR: torch.Tensor, mask_BR: torch.Tensor, level: str,
                 threshold: float) -> dict[str, torch.Tensor]:
    """Per-row values [B] the metrics of `is_metrics` are built from (rows without tokens give zeros): the token
    count, sums over the row's tokens of the weights before truncation (`is_raw_sum`), truncated (`is_trunc_sum`),
    clamped to [1/threshold, threshold] and its square, the weights above the threshold / below its reciprocal
    (token level: counts; sequence level: 0 or 1 for the row), and the row's largest / smallest weight before
    truncation (sequence level: from the unclamped row log-ratio, the largest capped at exp(20))."""
    log_w_BR, log_ratio = get_rollout_is(level)(old_logprobs_BR - rollout_logprobs_BR, mask_BR)
    raw_BR = torch.exp(log_w_BR) * mask_BR
    keep_BR, low = mask_BR.bool(), 1.0 / threshold
    tokens_B = mask_BR.sum(-1)
    valid_B = tokens_B > 0
    if level == "sequence":
        sum_B = log_ratio.squeeze(-1)
        log_high, log_low = (torch.log(torch.tensor(t, dtype=sum_B.dtype)) for t in (threshold, low))
        high_B, low_B = (sum_B > log_high).to(raw_BR.dtype), (sum_B < log_low).to(raw_BR.dtype)
        max_B, min_B = torch.exp(sum_B.clamp(max=SAFETY_BOUND)), torch.exp(sum_B)
    else:
        high_B = masked_sum((raw_BR > threshold).to(raw_BR.dtype), mask_BR, dim=-1)
        low_B = masked_sum((raw_BR < low).to(raw_BR.dtype), mask_BR, dim=-1)
        empty = raw_BR.shape[-1] == 0
        max_B = tokens_B * 0 if empty else raw_BR.masked_fill(~keep_BR, float("-inf")).amax(-1)
        min_B = tokens_B * 0 if empty else raw_BR.masked_fill(~keep_BR, float("inf")).amin(-1)
    clamped_BR = raw_BR.clamp(min=low, max=threshold)
    zero = torch.zeros_like(tokens_B)
    return {"tokens": tokens_B, "is_raw_sum": masked_sum(raw_BR, mask_BR, dim=-1),
            "is_trunc_sum": masked_sum(raw_BR.clamp(max=threshold), mask_BR, dim=-1),
            "is_clamped_sum": masked_sum(clamped_BR, mask_BR, dim=-1),
            "is_clamped_sq_sum": masked_sum(clamped_BR.square(), mask_BR, dim=-1),
            "is_high": torch.where(valid_B, high_B, zero), "is_low": torch.where(valid_B, low_B, zero),
            "is_max": torch.where(valid_B, max_B, zero), "is_min": torch.where(valid_B, min_B, zero)}


def is_metrics(rows: dict[str, torch.Tensor], level: str, threshold: float, batch_normalize: bool) -> dict[str, float]:
    """The metrics of `compute_rollout_is_weights` from `is_row_stats` of every row of the batch."""
    tokens_B = rows["tokens"].double()
    valid_B = tokens_B > 0
    if not bool(valid_B.any()):
        raise ValueError("rollout correction needs at least one response token; the batch has none")
    n = tokens_B.sum()
    per = n if level == "token" else valid_B.double().sum()  # the fractions count tokens, or rows
    total = {k: rows[k].double().sum() for k in ("is_raw_sum", "is_clamped_sum", "is_clamped_sq_sum", "is_high", "is_low")}
    clamped_mean = total["is_clamped_sum"] / n
    metrics = {
        "rollout_is_mean": float(total["is_raw_sum"] / n),
        "rollout_is_max": float(rows["is_max"][valid_B].max()),
        "rollout_is_min": float(rows["is_min"][valid_B].min()),
        "rollout_is_ratio_fraction_high": float(total["is_high"] / per),
        "rollout_is_ratio_fraction_low": float(total["is_low"] / per),
        # 1 / mean(w_n^2), w_n = clamped / (its mean + 1e-8)
        "rollout_is_eff_sample_size": float(1.0 / (total["is_clamped_sq_sum"] / (clamped_mean + 1e-8) ** 2 / n)),
    }
    if batch_normalize:
        metrics["rollout_is_batch_norm_factor"] = norm_factor(norm_sums(rows["tokens"], rows["is_trunc_sum"], level))
    return metrics


def compute_rollout_is_weights(
    old_logprobs_BR: torch.Tensor,
    rollout_logprobs_BR: torch.Tensor,
    mask_BR: torch.Tensor,
    level: str,
    threshold: float,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(weights_BR, metrics) of the whole batch: truncated importance weights of `level` (see the module docstring).

    Metrics (verl's names, without the `rollout_corr/` prefix): `rollout_is_mean/max/min` of the
    weights before truncation (sequence level: max/min from the unclamped row log-ratios),
    `rollout_is_ratio_fraction_high/low` (above the threshold / below its reciprocal; of the tokens, or
    sequence level of the rows), `rollout_is_eff_sample_size` (1 / mean(w_n^2) with w clamped to
    [1/threshold, threshold] and normalised to mean 1), and `rollout_is_batch_norm_factor` when normalising.
    """
    if not bool(mask_BR.bool().any()):
        raise ValueError("rollout correction needs at least one response token; the batch has none")
    weights_BR, _ = truncated_is_weights(old_logprobs_BR, rollout_logprobs_BR, mask_BR, level, threshold, batch_normalize)
    rows = is_row_stats(old_logprobs_BR, rollout_logprobs_BR, mask_BR, level, threshold)
    return weights_BR, is_metrics(rows, level, threshold, batch_normalize)
