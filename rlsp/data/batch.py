"""Batch: the one container that crosses process boundaries (tensordict + per-row metadata).

Tensors share the leading batch dimension B; `meta` holds per-row Python values (lists of length B,
e.g. uid, data_source, ground_truth); `info` holds batch-level values (e.g. sampling temperature).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict


@dataclass
class Batch:
    tensors: TensorDict
    meta: dict[str, list[Any]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self)
        for key, values in self.meta.items():
            if len(values) != n:
                raise ValueError(f"meta[{key!r}] has {len(values)} rows, tensors have {n}")

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor], meta: dict[str, list] | None = None,
                  info: dict | None = None) -> Batch:
        sizes = {t.shape[0] for t in tensors.values()}
        if len(sizes) != 1:
            raise ValueError(f"tensors disagree on batch size: { {k: v.shape for k, v in tensors.items()} }")
        td = TensorDict(tensors, batch_size=[sizes.pop()])
        return cls(td, dict(meta or {}), dict(info or {}))

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors.keys() or key in self.meta

    def keys(self) -> set[str]:
        """Names of every column: tensors and per-row meta."""
        return set(self.tensors.keys()) | set(self.meta)

    def copy(self) -> Batch:
        """The same rows whose columns can be replaced without changing this batch."""
        return Batch(self.tensors.clone(recurse=False), dict(self.meta), dict(self.info))

    def set(self, key: str, value: torch.Tensor) -> None:
        self.tensors.set(key, value)

    def select_rows(self, index: torch.Tensor | list[int] | slice) -> Batch:
        if isinstance(index, slice):
            rows = list(range(len(self)))[index]
        else:
            rows = [int(i) for i in index]
        idx = torch.as_tensor(rows, dtype=torch.long)
        meta = {k: [v[i] for i in rows] for k, v in self.meta.items()}
        return Batch(self.tensors[idx], meta, dict(self.info))

    def chunk(self, n_chunks: int) -> list[Batch]:
        """Split into `n_chunks` equal contiguous parts (B must be divisible)."""
        if len(self) % n_chunks != 0:
            raise ValueError(f"cannot split a batch of {len(self)} rows into {n_chunks} equal chunks")
        size = len(self) // n_chunks
        return [self.select_rows(slice(i * size, (i + 1) * size)) for i in range(n_chunks)]

    def split(self, size: int) -> list[Batch]:
        """Contiguous parts of at most `size` rows (last may be smaller)."""
        return [self.select_rows(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def concat(parts: list[Batch]) -> Batch:
        if not parts:
            raise ValueError("cannot concatenate an empty list of batches")
        tensors = torch.cat([p.tensors for p in parts], dim=0)
        meta = {k: [x for p in parts for x in p.meta[k]] for k in parts[0].meta}
        return Batch(tensors, meta, dict(parts[0].info))

    def update(self, other: Batch) -> Batch:
        """Add `other`'s tensors and meta (same rows) into this batch, in place; returns self."""
        if len(other) != len(self):
            raise ValueError(f"cannot merge batches of {len(self)} and {len(other)} rows")
        for key in other.tensors.keys():
            self.tensors.set(key, other.tensors[key])
        self.meta.update(other.meta)
        self.info.update(other.info)
        return self


def response_lengths(batch: Batch) -> list[int]:
    """Tokens after the prompt of every row: the whole trajectory, tool output included (multi-turn rows
    have zeros in `response_mask` where the policy did not write)."""
    mask = batch["response_mask"]
    if "attention_mask" not in batch:  # rows built without one (scoring-only batches) are single-turn
        return mask.sum(-1).long().tolist()
    return batch["attention_mask"][:, -mask.shape[1]:].sum(-1).long().tolist()


def last_policy_token(response_mask_BR: torch.Tensor) -> torch.Tensor:
    """[B] index of each row's last token with mask 1 (0 for a row without any): where outcome rewards go."""
    R = response_mask_BR.shape[1]
    positions_BR = torch.arange(R, device=response_mask_BR.device).expand_as(response_mask_BR)
    return torch.where(response_mask_BR > 0, positions_BR, torch.full_like(positions_BR, -1)).max(-1).values.clamp_min(0)

