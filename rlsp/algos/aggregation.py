"""Masked reductions, group statistics and loss aggregation.

The one normalisation used for training losses is :func:`aggregate_token_mean`: per-token losses
summed locally and divided by the *global* number of response tokens of the mini-batch (all ranks,
all micro-batches). Summing those partial losses (or their gradients) over micro-batches and ranks
gives exactly the token-mean over the mini-batch, whatever the split.

Shape legend: B rows (samples), R response length, T packed tokens, S sequences, "..." any shape.
Masks are bool or float tensors of the values' shape; masked-out positions never leak (even NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


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


def _per_sequence(
    values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked sums [S], token counts [S]) per sequence: rows of [B, R], or ``seq_index`` of [T]."""
    kept = _masked(values, mask)
    count = mask.to(values.dtype)
    if values.dim() == 2 and seq_index is None:
        return kept.sum(-1), count.sum(-1)
    if values.dim() == 1 and seq_index is not None:
        if seq_index.shape != values.shape:
            raise ValueError(f"seq_index shape {tuple(seq_index.shape)} != loss shape {tuple(values.shape)}")
        num_seqs = int(seq_index.max().item()) + 1 if seq_index.numel() else 0
        zeros_S = values.new_zeros(num_seqs)
        return zeros_S.index_add(0, seq_index, kept), zeros_S.index_add(0, seq_index, count)
    raise ValueError(
        f"sequence-level aggregation needs a [B, R] loss without seq_index or a packed [T] loss with "
        f"seq_index; got shape {tuple(values.shape)} and seq_index={'set' if seq_index is not None else None}"
    )


def aggregate_loss(
    loss_tokens: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scalar loss share of this micro-batch under ``mode``; sums over micro-batches/ranks add up.

    - "token-mean": see :func:`aggregate_token_mean` (needs ``global_token_count``).
    - "seq-mean-token-sum": sum over sequences of (token sum) / ``global_seq_count``.
    - "seq-mean-token-mean": sum over sequences of (token mean) / ``global_seq_count``.
    Sequence modes take a [B, R] loss (rows are sequences) or a packed [T] loss with ``seq_index``
    [T] (int64 sequence number of each token, 0..S-1).
    """
    if mode == "token-mean":
        return aggregate_token_mean(loss_tokens, mask, global_token_count)  # type: ignore[arg-type]
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; legal modes: {', '.join(AGGREGATION_MODES)}")
    _check_count("global_seq_count", global_seq_count)
    sums_S, counts_S = _per_sequence(loss_tokens, mask, seq_index)
    if mode == "seq-mean-token-mean":
        sums_S = sums_S / counts_S.clamp_min(1.0)
    return sums_S.sum() / global_seq_count
