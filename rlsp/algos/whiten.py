"""Whitening over all masked-in tokens of a batch, on one process or on a shard of the batch's rows.

An estimator that whitens (GAE, REINFORCE++) needs the mean and variance over every masked-in token of
the *batch*. On one process the rows are all here; on the workers each data-parallel rank holds a shard
of them. `masked_whiten` takes a `Reduce`: a function summing a tensor over the shards that together
hold the batch (None: this process holds the whole batch; on the workers an all-reduce over the
data-parallel ranks, rlsp.workers.step_stage). The statistics are sums, so any split of the rows gives
the same numbers up to the order of the additions:

    pass 1: reduce(sum x, count)          -> mean = sum / count
    pass 2: reduce(sum (x - mean)^2)      -> var  = that / count  (x count / (count - 1) when unbiased)

Two passes rather than one (sum, sum of squares, count): the one-pass variance loses every digit the
values share with their mean, and with `reduce=None` the two passes are exactly the one-process
computation (rlsp.algos.aggregation.masked_whiten, bit for bit).

Shape legend: "..." any shape (values and mask share it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlsp.algos.aggregation import masked_sum

# Sums a tensor over the shards holding the batch (returns a tensor of the same shape and dtype).
Reduce = Callable[[torch.Tensor], torch.Tensor]


def _reduced(x: torch.Tensor, reduce: Reduce | None) -> torch.Tensor:
    return x if reduce is None else reduce(x)


def masked_moments(values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True,
                   reduce: Reduce | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, variance) over the masked-in positions of every shard (count floored at 1; the variance
    Bessel-corrected when ``unbiased`` and the count exceeds 1)."""
    count = mask.to(values.dtype).sum()
    sum_and_count = _reduced(torch.stack([masked_sum(values, mask), count]), reduce)
    total, count = sum_and_count[0], sum_and_count[1]
    mean = total / count.clamp_min(1.0)
    var = _reduced(masked_sum((values - mean) ** 2, mask), reduce) / count.clamp_min(1.0)
    if unbiased:
        var = torch.where(count > 1, var * count / (count - 1).clamp_min(1.0), var)
    return mean, var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8,
                  reduce: Reduce | None = None) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) with the masked, unbiased statistics of all shards; exact zeros
    where masked out (NaN padding never leaks)."""
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(values.shape)}")
    mean, var = masked_moments(values, mask, reduce=reduce)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
