"""The update loop shared by the actor and the critic: PPO epochs over (shuffled) mini-batches.

Each rank holds its dp group's shard of the batch; a mini-batch is the same number of rows on every
dp rank. Rows are reshuffled every epoch with a generator seeded by (seed, step, epoch, dp rank), so
the order is reproducible and identical on the sp ranks of a group (which must see the same rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from rlsp.algos.aggregation import count_sequences
from rlsp.data.batch import Batch


def global_counts(mini: Batch, dp_group: dist.ProcessGroup) -> tuple[float, float]:
    """(response tokens, sequences with a response token) of the whole mini-batch, the loss's global
    normalisers (rlsp.algos.aggregation.LossScale): sp ranks hold identical rows, so reduce over dp only."""
    mask_BR = mini["response_mask"]
    counts = torch.stack([mask_BR.sum().to(torch.float64), count_sequences(mask_BR)])
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    tokens, seqs = counts.tolist()
    return tokens, seqs


def global_token_count(mini: Batch, dp_group: dist.ProcessGroup) -> float:
    """Response tokens of the whole mini-batch (see `global_counts`)."""
    return global_counts(mini, dp_group)[0]


def _epoch_order(n_rows: int, seed: int, step: int, epoch: int, dp_rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1009 + epoch) * 101 + dp_rank)
    return torch.randperm(n_rows, generator=gen)


def run_ppo_epochs(
    batch: Batch,
    mini_rows: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    dp_rank: int,
    train_mini: Callable[[Batch], dict[str, float]],
) -> dict[str, float]:
    """Call `train_mini` once per mini-batch and epoch; returns each metric averaged over the calls."""
    step = int(batch.info.get("global_step", 0))
    reshuffle = shuffle and (epochs > 1 or len(batch) > mini_rows)
    history: list[dict[str, float]] = []
    for epoch in range(epochs):
        rows = batch.select_rows(_epoch_order(len(batch), seed, step, epoch, dp_rank)) if reshuffle else batch
        for mini in rows.split(mini_rows):
            history.append(train_mini(mini))
    return {k: sum(h[k] for h in history) / len(history) for k in history[0]}
