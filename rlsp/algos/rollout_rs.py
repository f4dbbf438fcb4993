"""Rejection sampling between the trainer's policy and the rollout engine's (verl's
`algorithm.rollout_correction.rollout_rs`, its canonical option names).

With the log-ratio l = clamp(old - rollout, -20, 20) per token, three divergence statistics:

    k1 = -l                 (log pi_rollout / pi_old; bounded below and above)
    k2 = 0.5 * l^2          (upper bound only)
    k3 = exp(l) - 1 - l     (upper bound only)

An option `<level>_<k>` applies one of them at a level: `token` (each token alone) or `seq_sum`,
`seq_mean`, `seq_max` (the row's masked sum / mean / max decides for every token of the row;
`seq_max` exists for k2 and k3 only). A token is kept when its statistic is within the bounds:
k1 options keep log(lower) <= k1 <= log(upper), the others keep stat <= upper. Several options
(comma separated) must all keep a token. Rejected tokens leave the actor's loss (and its token count).

`rollout_rs_threshold`: one entry per option (comma separated) or one shared by all. k1 entries are
"lower_upper" ratio bounds (e.g. "0.5_2.0") or a single upper bound whose reciprocal is the lower one;
other entries are one positive upper bound.

Every decision is per token or per row, so a shard of the batch's rows gets the batch's mask for its rows;
the metrics are token or row means, built from the per-row values of `rs_row_stats` of every row (`rs_metrics`).

Shape legend: B rows, R response tokens.
"""

from __future__ import annotations

import math

import torch

from rlsp.algos.aggregation import masked_mean, masked_sum
from rlsp.algos.registry import get_rollout_rs, list_rollout_rs, register_rollout_rs

SAFETY_BOUND = 20.0
# verl's earlier option names; their ratio-bound semantics moved to the k1 options.
RENAMED = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def _statistic(k: str, log_ratio_BR: torch.Tensor) -> torch.Tensor:
    lr = log_ratio_BR.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if k == "k1":
        return -lr
    return 0.5 * lr.square() if k == "k2" else torch.exp(lr) - 1.0 - lr


def _row_max(values_BR: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    filled = values_BR.masked_fill(~mask_BR.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(filled), torch.zeros_like(filled), filled)


def _aggregate(level: str, stat_BR: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    if level == "token":
        return stat_BR
    if level == "seq_sum":
        row_B = masked_sum(stat_BR, mask_BR, dim=-1)
    elif level == "seq_mean":
        row_B = masked_mean(stat_BR, mask_BR, dim=-1)
    else:
        row_B = _row_max(stat_BR, mask_BR)
    return row_B.unsqueeze(-1).expand_as(stat_BR)


def _make_option(level: str, k: str):
    def keep(log_ratio_BR: torch.Tensor, mask_BR: torch.Tensor, lower: float | None, upper: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
        stat_BR = _aggregate(level, _statistic(k, log_ratio_BR), mask_BR)
        if k == "k1":
            return (stat_BR >= math.log(lower)) & (stat_BR <= math.log(upper)), stat_BR
        return stat_BR <= upper, stat_BR

    keep.__name__ = f"{level}_{k}"
    return keep


for _level in ("token", "seq_sum", "seq_mean", "seq_max"):
    for _k in ("k1", "k2", "k3"):
        if not (_level == "seq_max" and _k == "k1"):
            register_rollout_rs(f"{_level}_{_k}", _make_option(_level, _k))


def parse_rs_options(spec: str) -> list[str]:
    """The options of a comma-separated `rollout_rs` string (duplicates dropped), each checked by name."""
    options = list(dict.fromkeys(o.strip() for o in str(spec).split(",") if o.strip()))
    if not options:
        raise ValueError(f"algorithm.rollout_correction.rollout_rs={spec!r} names no option; legal: {list_rollout_rs()}")
    for opt in options:
        if opt in RENAMED:
            raise ValueError(f"algorithm.rollout_correction.rollout_rs={opt!r} is verl's earlier name; use the current "
                             f"option {RENAMED[opt]!r} (bounds on -log ratio, see docs/async.md); legal: {list_rollout_rs()}")
        get_rollout_rs(opt)  # ValueError naming the legal options
    return options


def parse_rs_thresholds(options: list[str], spec: str | float | None) -> list[tuple[float | None, float]]:
    """(lower, upper) per option from `rollout_rs_threshold` (see the module docstring)."""
    key = "algorithm.rollout_correction.rollout_rs_threshold"
    if spec is None:
        raise ValueError(f"{key} must be set when rollout_rs is (e.g. 2.0, or '0.5_2.0' for k1 options)")
    entries = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(entries) not in (1, len(options)):
        raise ValueError(f"{key}={spec!r} has {len(entries)} entries for {len(options)} rollout_rs options {options}; "
                         "give one shared entry or one per option")
    entries = entries * len(options) if len(entries) == 1 else entries
    bounds = []
    for opt, entry in zip(options, entries):
        parts = entry.split("_")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"{key}: entry {entry!r} for {opt} is not a number (or 'lower_upper')") from None
        if any(v <= 0 for v in values) or len(values) > 2 or (len(values) == 2 and not opt.endswith("k1")):
            raise ValueError(f"{key}: entry {entry!r} for {opt} must be one positive upper bound"
                             + (" or positive 'lower_upper' bounds" if opt.endswith("k1") else ""))
        upper = values[-1]
        lower = (values[0] if len(values) == 2 else 1.0 / upper) if opt.endswith("k1") else None
        bounds.append((lower, upper))
    return bounds


def rs_row_stats(old_logprobs_BR: torch.Tensor, rollout_logprobs_BR: torch.Tensor, mask_BR: torch.Tensor,
                 spec: str, threshold: str | float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(mask_BR with rejected tokens set to 0, per-row values the metrics of `rs_metrics` are built from): the
    token count, the rejected tokens (`rs_rejected`), whether the row lost a token (`rs_row_rejected`), and per
    option [B, options] its rejected tokens and its statistic's sum over the row's tokens."""
    options = parse_rs_options(spec)
    log_ratio_BR = old_logprobs_BR - rollout_logprobs_BR
    keep_BR = torch.ones_like(mask_BR, dtype=torch.bool)
    rejected, stat_sums = [], []
    for opt, (lower, upper) in zip(options, parse_rs_thresholds(options, threshold)):
        keep_opt, stat_BR = get_rollout_rs(opt)(log_ratio_BR, mask_BR, lower, upper)
        keep_BR &= keep_opt
        rejected.append(masked_sum((~keep_opt).to(mask_BR.dtype), mask_BR, dim=-1))
        stat_sums.append(masked_sum(stat_BR, mask_BR, dim=-1))
    rejected_BR = mask_BR.bool() & ~keep_BR
    rows = {"tokens": mask_BR.sum(-1), "rs_rejected": rejected_BR.to(mask_BR.dtype).sum(-1),
            "rs_row_rejected": rejected_BR.any(dim=-1).to(mask_BR.dtype),
            "rs_option_rejected": torch.stack(rejected, dim=-1), "rs_option_stat_sum": torch.stack(stat_sums, dim=-1)}
    return mask_BR * keep_BR.to(mask_BR.dtype), rows


def rs_metrics(rows: dict[str, torch.Tensor], spec: str) -> dict[str, float]:
    """The metrics of `compute_rollout_rs_mask` from `rs_row_stats` of every row of the batch."""
    n = rows["tokens"].double().sum().clamp_min(1.0)
    rejected_BO, stat_BO = rows["rs_option_rejected"].double().sum(0), rows["rs_option_stat_sum"].double().sum(0)
    metrics: dict[str, float] = {}
    for o, opt in enumerate(parse_rs_options(spec)):
        metrics[f"rollout_rs_{opt}_masked_fraction"] = float(rejected_BO[o] / n)
        metrics[f"rollout_rs_{opt}_mean"] = float(stat_BO[o] / n)
    metrics["rollout_rs_masked_fraction"] = float(rows["rs_rejected"].double().sum() / n)
    metrics["rollout_rs_seq_masked_fraction"] = float(rows["rs_row_rejected"].double().mean())
    return metrics


def compute_rollout_rs_mask(old_logprobs_BR: torch.Tensor, rollout_logprobs_BR: torch.Tensor, mask_BR: torch.Tensor,
                            spec: str, threshold: str | float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """(mask_BR with rejected tokens set to 0, metrics) of the whole batch: `rollout_rs_masked_fraction` (tokens),
    `rollout_rs_seq_masked_fraction` (rows with a rejected token), and per option
    `rollout_rs_<opt>_masked_fraction` and `rollout_rs_<opt>_mean` (its statistic's token mean)."""
    new_mask_BR, rows = rs_row_stats(old_logprobs_BR, rollout_logprobs_BR, mask_BR, spec, threshold)
    return new_mask_BR, rs_metrics(rows, spec)
