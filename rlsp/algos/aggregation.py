"""Masked reductions, group statistics and loss aggregation.

Training losses are aggregated as verl's `loss_agg_mode` says (token-mean, seq-mean-token-sum,
seq-mean-token-mean, seq-mean-token-sum-norm), but always over the *whole* mini-batch: each token
gets a weight from its full row where the rows are known (:func:`compute_token_weights`: 1, or 1 / the
row's tokens) and the mini-batch one global divisor (:func:`loss_divisor`: its tokens, its sequences,
...), and each shard sums loss x weight / divisor over its tokens. Summing those partial losses (or their gradients) over micro-batches,
data-parallel and sequence-parallel ranks gives exactly the mini-batch loss, whatever the split.

Shape legend: B rows (samples), R response length, T packed tokens, S sequences, "..." any shape.
Masks are bool or float tensors of the values' shape; masked-out positions never leak (even NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rlsp.config.choices import LOSS_AGG_MODES

# One list of legal modes (rlsp.config.choices validates actor/critic loss_agg_mode against it).
AGGREGATION_MODES = LOSS_AGG_MODES


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Values where the mask is set, exact zeros elsewhere (so NaN/inf padding cannot leak)."""
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(values.shape)}")
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over masked-in positions (all dims, or along ``dim``)."""
    kept = _masked(values, mask)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked-in positions; an empty mask gives 0 (count floored at 1), not NaN."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp_min(1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked-in positions (Bessel-corrected when ``unbiased`` and count > 1)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        var = torch.where(count > 1, var * count / (count - 1).clamp_min(1.0), var)
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) with masked (unbiased) statistics; zeros where masked out.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised).
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _masked(whitened, mask)


def group_ids(index: Sequence[str] | np.ndarray | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """(dense group numbers [B] in 0..G-1 as int64, G) for per-row group ids of any sortable kind.

    G comes from the host-side ids, so no device synchronisation is needed.
    """
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    uniques, inverse = np.unique(np.asarray(index), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device), len(uniques)


def group_mean_std(
    scores_B: torch.Tensor, index: Sequence[str] | np.ndarray | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (group mean, group unbiased std, group size), each [B].

    A group of size 1 gets mean 0 and std 1 by convention, so its single sample keeps its raw score
    as advantage (there is nothing to compare it with, and a zero std would divide by ~0).
    """
    if scores_B.dim() != 1 or len(index) != scores_B.shape[0]:
        raise ValueError(f"need one group id per row: {len(index)} ids for scores {tuple(scores_B.shape)}")
    gid_B, num_groups = group_ids(index, scores_B.device)
    zeros_G = scores_B.new_zeros(num_groups)
    count_G = zeros_G.index_add(0, gid_B, torch.ones_like(scores_B))
    mean_G = zeros_G.index_add(0, gid_B, scores_B) / count_G
    sq_dev_G = zeros_G.index_add(0, gid_B, (scores_B - mean_G[gid_B]) ** 2)
    std_G = torch.sqrt(sq_dev_G / (count_G - 1).clamp_min(1.0))
    single_G = count_G < 2
    mean_G = torch.where(single_G, torch.zeros_like(mean_G), mean_G)
    std_G = torch.where(single_G, torch.ones_like(std_G), std_G)
    return mean_G[gid_B], std_G[gid_B], count_G[gid_B]


def _check_count(name: str, count: float | torch.Tensor | None) -> None:
    if count is None:
        raise ValueError(f"{name} is required for this aggregation mode")
    if float(count) <= 0:
        raise ValueError(f"{name} must be > 0, got {float(count)}")


def aggregate_token_mean(
    loss_tokens: torch.Tensor, mask: torch.Tensor, global_token_count: float | torch.Tensor
) -> torch.Tensor:
    """sum(loss * mask) / global_token_count: this micro-batch's share of the global token-mean."""
    _check_count("global_token_count", global_token_count)
    return masked_sum(loss_tokens, mask) / global_token_count


@dataclass(frozen=True)
class LossScale:
    """What a mini-batch's loss is normalised by (verl's `agg_loss` with global counts).

    ``global_tokens``: response tokens of the whole mini-batch (all ranks and micro-batches);
    ``global_seqs``: its sequences with at least one response token (verl leaves fully masked
    sequences out of the sequence mean); ``horizon``: seq-mean-token-sum-norm's constant divisor
    (verl's loss_scale_factor; None = the rows' response width, verl's loss_mask.shape[-1]).
    """

    mode: str = "token-mean"
    global_tokens: float | None = None
    global_seqs: float | None = None
    horizon: float | None = None


def count_sequences(mask_BR: torch.Tensor) -> torch.Tensor:
    """Rows with at least one masked-in token (the sequences a sequence mean counts), as a float scalar."""
    return (mask_BR.sum(-1) > 0).to(torch.float64).sum()


def loss_divisor(scale: LossScale, response_width: int) -> float:
    """The mini-batch's global divisor under ``scale.mode``: global tokens (token-mean), global sequences
    (seq-mean-token-sum / -token-mean) or global sequences x horizon (seq-mean-token-sum-norm; the
    horizon defaults to ``response_width``, verl's loss_mask.shape[-1])."""
    if scale.mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {scale.mode!r}; legal modes: {', '.join(AGGREGATION_MODES)}")
    if scale.mode == "token-mean":
        _check_count("global_token_count", scale.global_tokens)
        return float(scale.global_tokens)  # type: ignore[arg-type]
    _check_count("global_seq_count", scale.global_seqs)
    if scale.mode != "seq-mean-token-sum-norm":
        return float(scale.global_seqs)  # type: ignore[arg-type]
    horizon = response_width if scale.horizon is None else scale.horizon
    _check_count("horizon (loss_scale_factor)", horizon)
    return float(scale.global_seqs) * float(horizon)  # type: ignore[arg-type]


def compute_token_weights(mask_BR: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token weights [B, R] relative to :func:`loss_divisor` (0 where masked out): 1 for every mode
    but seq-mean-token-mean, where a row's tokens share its weight (1 / tokens of the row). They depend
    on the full rows only, so any split of the rows (micro-batches, dp ranks) and of the tokens
    (sequence-parallel shards) sums loss x weight / divisor to exactly the mini-batch loss:

    - "token-mean": sum(loss) / global_tokens;
    - "seq-mean-token-sum": sum(loss) / global_seqs;
    - "seq-mean-token-mean": sum over rows of (row's token mean) / global_seqs;
    - "seq-mean-token-sum-norm": sum(loss) / (global_seqs * horizon) (Dr. GRPO: a constant instead of
      each row's length).
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; legal modes: {', '.join(AGGREGATION_MODES)}")
    ones_BR = (mask_BR != 0).to(torch.float64)
    if mode != "seq-mean-token-mean":
        return ones_BR
    return ones_BR / ones_BR.sum(-1, keepdim=True).clamp_min(1.0)


def weighted_sum(loss_tokens: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, divisor: float) -> torch.Tensor:
    """sum(loss * weights) / divisor over masked-in tokens: this shard's share of the aggregated loss."""
    return masked_sum(loss_tokens * weights.to(loss_tokens.dtype), mask) / divisor


def aggregate_loss(loss_BR: torch.Tensor, mask_BR: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """Loss share of rows [B, R] (rows are sequences) under ``scale`` (see :func:`compute_token_weights`);
    with the counts of these rows alone it is verl's ``agg_loss`` of them."""
    if loss_BR.dim() != 2:
        raise ValueError(f"aggregate_loss takes a [B, R] loss (rows are sequences), got shape {tuple(loss_BR.shape)}")
    divisor = loss_divisor(scale, loss_BR.shape[-1])
    return weighted_sum(loss_BR, mask_BR, compute_token_weights(mask_BR, scale.mode), divisor)
