"""Rollout correction: importance weights and rejection masks between the rollout engine's policy
(which sampled) and the trainer's (which the PPO loss is built around), with off-policy diagnostics.

Settings are verl's `algorithm.rollout_correction.*`; the weights come from rlsp/algos/rollout_is.py,
the masks from rlsp/algos/rollout_rs.py. Metrics carry verl's names under `rollout_corr/`. With
`bypass_mode=true` the same correction runs inside the policy loss instead, per micro-batch, from the
current logprobs (rlsp/algos/bypass.py; `loss_type` picks that loss).

On one process `compute_rollout_correction` corrects the whole batch. On the policy workers each data-parallel
rank corrects its shard of the rows (`correction_rows`, rlsp.workers.stage_correction): weights and masks are per
token or per row, the batch normalisation's mean is one sum over the shards (`reduce`), and every metric is a
token or row mean, max or min of per-row values (`ROW_STATS`), which the driver gathers and reduces
(`correction_metrics`): the whole-batch function is those two steps on one process.

Shape legend: B rows, R response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlsp.algos.aggregation import masked_mean, masked_sum
from rlsp.algos.rollout_is import SAFETY_BOUND, is_metrics, is_row_stats, truncated_is_weights
from rlsp.algos.rollout_rs import rs_metrics, rs_row_stats
from rlsp.algos.whiten import Reduce
from rlsp.config.choices import BYPASS_LOSS_TYPES

__all__ = ["BYPASS_LOSS_TYPES", "ROW_STATS", "RolloutCorrection", "compute_offpolicy_metrics", "compute_rollout_correction",
           "correction_metrics", "correction_rows"]

# The per-row values `correction_rows` gives (those of the parts the settings turn on): [B], the last two
# [B, rollout_rs options].
ROW_STATS = ("tokens", "kl_sum", "k3_kl_sum", "rho_sq_sum", "seq_rho_sq", "training_ppl", "rollout_ppl",
             "is_raw_sum", "is_trunc_sum", "is_clamped_sum", "is_clamped_sq_sum", "is_high", "is_low", "is_max", "is_min",
             "rs_rejected", "rs_row_rejected", "rs_option_rejected", "rs_option_stat_sum")


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


def offpolicy_row_stats(old_BR: torch.Tensor, rollout_BR: torch.Tensor, mask_BR: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row values [B] of the off-policy diagnostics: sums over the row's tokens of rollout - old, k3 and rho^2,
    the row's (prod rho)^2, and each policy's perplexity of the row."""
    log_ratio = old_BR - rollout_BR
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    row_sum = masked_sum(log_ratio, mask_BR, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"tokens": mask_BR.sum(-1), "kl_sum": masked_sum(-log_ratio, mask_BR, dim=-1),
            "k3_kl_sum": masked_sum(torch.exp(log_ratio) - log_ratio - 1.0, mask_BR, dim=-1),
            "rho_sq_sum": masked_sum(rho.square(), mask_BR, dim=-1), "seq_rho_sq": torch.exp(2.0 * row_sum),
            "training_ppl": torch.exp(-masked_mean(old_BR, mask_BR, dim=-1)),
            "rollout_ppl": torch.exp(-masked_mean(rollout_BR, mask_BR, dim=-1))}


def offpolicy_metrics(rows: dict[str, torch.Tensor]) -> dict[str, float]:
    """`compute_offpolicy_metrics` from `offpolicy_row_stats` of every row of the batch."""
    n = rows["tokens"].double().sum().clamp_min(1.0)
    token_mean = {k: rows[k].double().sum() / n for k in ("kl_sum", "k3_kl_sum", "rho_sq_sum")}
    return {"kl": float(token_mean["kl_sum"]), "k3_kl": float(token_mean["k3_kl_sum"]),
            "chi2_token": float(token_mean["rho_sq_sum"]) - 1.0, "chi2_seq": float(rows["seq_rho_sq"].double().mean()) - 1.0,
            "training_ppl": float(rows["training_ppl"].double().mean()),
            "rollout_ppl": float(rows["rollout_ppl"].double().mean())}


def compute_offpolicy_metrics(old_BR: torch.Tensor, rollout_BR: torch.Tensor, mask_BR: torch.Tensor) -> dict[str, float]:
    """kl = mean(rollout - old) (KL(rollout || old), sampled from rollout), k3_kl, chi2_token =
    E[rho^2] - 1, chi2_seq = E_rows[(prod rho)^2] - 1, and each policy's mean per-row perplexity."""
    return offpolicy_metrics(offpolicy_row_stats(old_BR, rollout_BR, mask_BR))


def correction_rows(
    old_logprobs_BR: torch.Tensor, rollout_logprobs_BR: torch.Tensor, mask_BR: torch.Tensor,
    settings: RolloutCorrection, reduce: Reduce | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """(is_weights_BR or None, mask_BR after rejection, per-row values of the metrics: `ROW_STATS`) of these rows;
    `reduce` sums the batch normalisation's statistic over the shards that hold the batch (None: the whole
    batch is here). `correction_metrics` of the row values of every row gives the batch's metrics."""
    if old_logprobs_BR.shape != rollout_logprobs_BR.shape or old_logprobs_BR.shape != mask_BR.shape:
        raise ValueError(f"old {tuple(old_logprobs_BR.shape)}, rollout {tuple(rollout_logprobs_BR.shape)} and mask "
                         f"{tuple(mask_BR.shape)} logprobs must have one shape")
    rows = offpolicy_row_stats(old_logprobs_BR, rollout_logprobs_BR, mask_BR)
    weights_BR = None
    if settings.rollout_is is not None:
        weights_BR, _ = truncated_is_weights(old_logprobs_BR, rollout_logprobs_BR, mask_BR, settings.rollout_is,
                                             settings.rollout_is_threshold, settings.rollout_is_batch_normalize, reduce)
        rows.update(is_row_stats(old_logprobs_BR, rollout_logprobs_BR, mask_BR, settings.rollout_is,
                                 settings.rollout_is_threshold))
    new_mask_BR = mask_BR
    if settings.rollout_rs is not None:
        new_mask_BR, rs_rows = rs_row_stats(old_logprobs_BR, rollout_logprobs_BR, mask_BR, settings.rollout_rs,
                                            settings.rollout_rs_threshold)
        rows.update(rs_rows)
    return weights_BR, new_mask_BR, rows


def correction_metrics(rows: dict[str, torch.Tensor], settings: RolloutCorrection) -> dict[str, float]:
    """The metrics under `rollout_corr/` from `correction_rows`' per-row values of every row of the batch."""
    metrics: dict[str, float] = {}
    if settings.rollout_is is not None:
        metrics.update(is_metrics(rows, settings.rollout_is, settings.rollout_is_threshold,
                                  settings.rollout_is_batch_normalize))
    if settings.rollout_rs is not None:
        metrics.update(rs_metrics(rows, settings.rollout_rs))
    metrics.update(offpolicy_metrics(rows))
    return {f"rollout_corr/{k}": v for k, v in metrics.items()}


def compute_rollout_correction(
    old_logprobs_BR: torch.Tensor, rollout_logprobs_BR: torch.Tensor, mask_BR: torch.Tensor,
    settings: RolloutCorrection,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(is_weights_BR or None, mask_BR after rejection, metrics under `rollout_corr/`) of the whole batch.

    The weights are computed on every token of `mask_BR` and rejection only zeroes the mask: a
    rejected token keeps its weight, but leaves the loss through the mask (as in verl)."""
    if settings.rollout_is is not None and not bool(mask_BR.bool().any()):
        raise ValueError("rollout correction needs at least one response token; the batch has none")
    weights_BR, new_mask_BR, rows = correction_rows(old_logprobs_BR, rollout_logprobs_BR, mask_BR, settings)
    return weights_BR, new_mask_BR, correction_metrics(rows, settings)
