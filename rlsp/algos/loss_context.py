"""What a policy loss may know beyond its own tokens: statistics of whole rows and of the whole micro-batch.

A loss runs on the tokens one rank holds: with sequence parallelism (Ulysses, ring, tp) that is a shard
of a packed micro-batch, so a row's other tokens live on other ranks. Sequence-level losses (GSPO's
sequence ratio, GMPO's geometric mean) and batch-level ones (clip_cov / kl_cov statistics) read such
quantities through a :class:`LossContext`, which the actor builds per micro-batch (the collective part
lives in rlsp/workers; nothing here touches torch.distributed). Every value a context returns is
detached: gradients flow only through the loss's own tokens, so a sequence-level loss is written as a
per-token surrogate whose value and gradient equal the paper's (e.g. sg(L_i) * (1 + x_t - sg(x_t))).

The primitives: ``to_batch`` (every response token of the micro-batch, all shards, one fixed order the
same on every rank: row-major, rows in micro-batch order) and ``from_batch`` (back to this rank's tokens),
plus ``row_ids`` (the row of each of those tokens). Row and batch statistics are built on them.

:class:`RowContext` is the context of whole rows held in one tensor ([B, R] with a mask): the default of a
loss called without one (unit tests, padded rows).

Shape legend: "..." a loss's token shape ([S] local tokens of a packed stream, or [B, R] rows);
N response tokens of the micro-batch (all shards); B rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class LossContext(ABC):
    """Whole-row and whole-micro-batch views of per-token values; every result is detached."""

    @property
    @abstractmethod
    def row_ids(self) -> torch.Tensor:
        """[N] int64: the row (0..num_rows-1) of each response token, in ``to_batch`` order."""

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Rows of the micro-batch (all of them, including rows without response tokens)."""

    @abstractmethod
    def to_batch(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values [...] of this rank -> [N] values of every response token of the micro-batch
        (collective across the shards of a row; detached). Masked-out positions are never read."""

    @abstractmethod
    def from_batch(self, values_N: torch.Tensor) -> torch.Tensor:
        """[N] values in ``to_batch`` order -> this rank's tokens [...] (0 where not a response token).
        Local only: no communication."""

    def row_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Each token gets the sum of ``values`` over its whole row's response tokens (all shards) [...]."""
        batch = self.to_batch(values)
        sums_B = batch.new_zeros(self.num_rows).index_add(0, self.row_ids.to(batch.device), batch)
        return self.from_batch(sums_B[self.row_ids.to(batch.device)])

    def row_tokens(self, like: torch.Tensor) -> torch.Tensor:
        """Each token gets the number of response tokens of its row [...] (dtype and device of ``like``)."""
        ids = self.row_ids.to(like.device)
        counts_B = torch.zeros(self.num_rows, dtype=like.dtype, device=like.device).index_add(
            0, ids, torch.ones(ids.shape, dtype=like.dtype, device=like.device))
        return self.from_batch(counts_B[ids])

    def row_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Each token gets the mean of ``values`` over its row's response tokens [...]."""
        return self.row_sum(values) / self.row_tokens(values).clamp_min(1.0)

    def batch_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Scalar: the sum of ``values`` over every response token of the micro-batch (all shards)."""
        return self.to_batch(values).sum()

    def batch_tokens(self) -> int:
        """N: the response tokens of the micro-batch (all shards)."""
        return int(self.row_ids.numel())


class RowContext(LossContext):
    """The context of rows held whole in one tensor: values [..., R] with a mask of the same shape, where
    every index but the last names a row (e.g. [B, R] padded responses)."""

    def __init__(self, mask: torch.Tensor) -> None:
        if mask.dim() < 2:
            raise ValueError(f"RowContext needs rows [..., R]; got a mask of shape {tuple(mask.shape)} (a packed "
                             "stream needs the context of its micro-batch)")
        self._mask = mask.detach().bool()
        rows = self._mask.reshape(-1, self._mask.shape[-1])
        self._row_ids = rows.nonzero()[:, 0]
        self._num_rows = rows.shape[0]

    @property
    def row_ids(self) -> torch.Tensor:
        return self._row_ids

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def to_batch(self, values: torch.Tensor) -> torch.Tensor:
        if values.shape != self._mask.shape:
            raise ValueError(f"values shape {tuple(values.shape)} != mask shape {tuple(self._mask.shape)}")
        return values.detach()[self._mask.to(values.device)]

    def from_batch(self, values_N: torch.Tensor) -> torch.Tensor:
        mask = self._mask.to(values_N.device)
        out = torch.zeros(mask.shape, dtype=values_N.dtype, device=values_N.device)
        out[mask] = values_N.detach()
        return out


def context_or_rows(context: LossContext | None, mask: torch.Tensor) -> LossContext:
    """``context``, or the :class:`RowContext` of ``mask`` when a loss is called on whole rows without one."""
    return RowContext(mask) if context is None else context
