"""StepData: a step's rows as the driver holds them — per-row values here, the rows' columns in the
processes that made them.

Every role call that returns a Batch leaves it where it was computed (a *block* in Ray's object store,
owned by the worker); the driver keeps a handle and the per-row values the method reports (row
lengths, uid, scores). A later call's workers receive, for their rows, the blocks that hold the
columns they declared (Ray moves them worker to worker) and the columns the driver holds, by value.
Row order and selection (balancing, filtering) are decided by the driver on its per-row values alone:
`select_rows` reorders handles, nothing moves.

StepData reads like a Batch for the driver's own computations (`data[key]`, `data.meta[...]`,
`select_rows`, `update`, `concat`) on the columns the driver holds. A column the workers hold comes to
the driver only by an explicit call, `read_columns(wg, data, names)` (rlsp.controller.reads): one call
on a worker group whose rank 0 builds just those columns from the blocks (counted:
rlsp.controller.traffic), so a driver-side computation pays for exactly the columns it names. Indexing
a column nobody read raises `ColumnNotRead` naming it: nothing is fetched as a side effect of indexing.
A column built on the driver (`derive`) is built from the row's own columns, so selecting rows carries
the build along, and concatenating steps that all build it joins their builds (`concat`). A *row
broadcast* (`set_row`: one value per row for every response token, e.g. an outcome advantage) travels
as one number per row and becomes `value * response_mask` where it is used.

Rows have ids unique in the driver process, so the rows of several generation calls (asynchronous
units, dynamic sampling rounds) concatenate without renumbering.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from rlsp.controller.step_meta import ColumnNotRead, LazyMeta
from rlsp.data.batch import Batch
from rlsp.workers.columns import ROW_SUFFIX, Piece, RowsSpec

_ROW_IDS = itertools.count()


def new_row_ids(n: int) -> list[int]:
    return [next(_ROW_IDS) for _ in range(n)]



@dataclass(frozen=True)
class Block:
    """A Batch held by another process: `keys` of rows `ids` (in the block's order)."""

    ref: Any
    keys: frozenset[str]
    ids: tuple[int, ...]


def _empty(n: int, meta: dict[str, list[Any]] | None = None, info: dict[str, Any] | None = None) -> Batch:
    return Batch(TensorDict({}, batch_size=[n]), dict(meta or {}), dict(info or {}))


class StepData:
    def __init__(self, ids: Sequence[int], table: Batch, blocks: Sequence[Block] = (),
                 tensor_keys: Iterable[str] = ()) -> None:
        self.ids = list(ids)
        self.table = table  # the driver's columns, rows in `ids` order
        self.blocks = list(blocks)
        self._tensor_keys = set(tensor_keys)  # block keys that are tensors (the rest are per-row meta)
        self._derived: dict[str, Callable[[StepData], torch.Tensor]] = {}  # built on the driver when first read
        self._aliases: dict[str, str] = {}  # name -> the block column that serves as it
        if len(self.table) != len(self.ids):
            raise ValueError(f"{len(self.table)} driver rows for {len(self.ids)} row ids")

    # ------------------------------------------------------------------ Batch-like reading
    @property
    def info(self) -> dict[str, Any]:
        return self.table.info

    @property
    def meta(self) -> LazyMeta:
        return LazyMeta(self)

    def __len__(self) -> int:
        return len(self.ids)

    def block_keys(self) -> set[str]:
        return {k for b in self.blocks for k in b.keys}

    def unread(self, names: Iterable[str]) -> list[str]:
        """The block columns among `names` (aliases resolved) the driver does not hold yet, sorted."""
        held = set(self.table.tensors.keys()) | set(self.table.meta)
        blocks = self.block_keys()
        return sorted({k for k in (self._aliases.get(n, n) for n in names) if k in blocks and k not in held})

    def is_tensor(self, key: str) -> bool:
        return key in self._tensor_keys

    def __contains__(self, key: str) -> bool:
        return (key in self.table or key in self.block_keys() or key + ROW_SUFFIX in self.table.tensors.keys()
                or key in self._derived or key in self._aliases)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.table.tensors.keys():
            return self.table[key]
        if key + ROW_SUFFIX in self.table.tensors.keys():  # a row broadcast read on the driver: expand it here
            values_B = self.table.tensors.pop(key + ROW_SUFFIX)
            self.table.set(key, values_B.unsqueeze(-1) * self["response_mask"])
            return self.table[key]
        if key in self._derived:
            value = self._derived[key](self)  # may raise ColumnNotRead: the build stays until its inputs are here
            del self._derived[key]
            self.set(key, value)
            return self.table[key]
        if key in self._aliases:
            return self[self._aliases[key]]
        if key not in self.block_keys():
            raise KeyError(f"{key!r} is not a column of this step (it has {sorted(self.keys())})")
        raise ColumnNotRead(key)

    def keys(self) -> set[str]:
        return ({k.removesuffix(ROW_SUFFIX) for k in self.table.tensors.keys()} | set(self.table.meta)
                | self.block_keys() | set(self._aliases) | set(self._derived))

    def set(self, key: str, value: torch.Tensor) -> None:
        """A column computed on the driver (later calls that read it get it by value)."""
        self.table.tensors.pop(key + ROW_SUFFIX, None)
        self._aliases.pop(key, None)
        self.table.set(key, value)

    def alias(self, name: str, source: str) -> None:
        """Block column `source` serves as `name` (e.g. the rollout's logprobs as the old logprobs): readers
        of `name` get it from the blocks, nothing is copied or sent by the driver."""
        if source not in self.block_keys():
            raise KeyError(f"{source!r} is not a column the workers hold for this step")
        self.table.tensors.pop(name, None)
        self._aliases[name] = source

    def derive(self, key: str, build: Callable[[StepData], torch.Tensor]) -> None:
        """Column `key` = build(self), computed on the driver only if something reads it. `build` computes each
        row from that row's own columns (and values it keeps by row id), so a selection of the rows keeps it."""
        self.table.tensors.pop(key, None)
        self._derived[key] = build

    def builds(self, name: str) -> bool:
        """Whether the driver builds column `name` from others when it is read (`derive`, `set_row`)."""
        return name in self._derived or self.row_value(name) is not None

    def source_of(self, name: str) -> str:
        """The column `name` is read from (itself unless it is an alias)."""
        return self._aliases.get(name, name)

    def set_row(self, key: str, values_B: torch.Tensor) -> None:
        """`key` = values_B[:, None] * response_mask, kept as one value per row (see the module docstring)."""
        self.table.tensors.pop(key, None)
        self.table.set(key + ROW_SUFFIX, values_B)

    def row_value(self, key: str) -> torch.Tensor | None:
        """The per-row values of a row broadcast `key`, None if it is not one."""
        name = key + ROW_SUFFIX
        return self.table[name] if name in self.table.tensors.keys() else None

    # ------------------------------------------------------------------ where columns live
    def _where(self, key: str) -> dict[int, tuple[int, int]]:
        """Row id -> (block index, position in the block) for the block column `key` (newest block wins)."""
        where: dict[int, tuple[int, int]] = {}
        for b, block in enumerate(self.blocks):
            if key in block.keys:
                where.update({rid: (b, pos) for pos, rid in enumerate(block.ids)})
        return where

    def spec(self, positions: Sequence[int], reads: Iterable[str]) -> tuple[RowsSpec, list[Any]]:
        """How a process builds rows `positions` (of the current order) with the columns in `reads` it
        can have: (the spec, the block refs it receives, in argument order). No positions (a dp group without
        rows in an uneven cut) still give every column, with no rows: the process gets one block holding each,
        so its empty tensors have the column's dtype and trailing shape (its collectives match its peers')."""
        reads = set(reads)
        table_keys = {k for k in reads if k in self.table.tensors.keys() or k in self.table.meta}
        table_keys |= {k + ROW_SUFFIX for k in reads if k + ROW_SUFFIX in self.table.tensors.keys()}
        picks = self.table.select_rows(list(positions))
        by_value = _empty(len(positions), {k: picks.meta[k] for k in table_keys if k in picks.meta}, None)
        for k in table_keys & set(picks.tensors.keys()):
            by_value.set(k, picks[k])
        routes: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[tuple[str, str]]] = {}
        for name in sorted(reads - table_keys - {k.removesuffix(ROW_SUFFIX) for k in table_keys}):
            key = self._aliases.get(name, name)
            where = self._where(key)
            if not where:
                continue  # not a column of this step: an optional read
            per_block: dict[int, tuple[list[int], list[int]]] = {}
            for dst, pos in enumerate(positions):
                b, src = where[self.ids[pos]]
                per_block.setdefault(b, ([], []))
                per_block[b][0].append(src)
                per_block[b][1].append(dst)
            if not positions:  # an empty shard: no rows of one block that holds the column (its dtype and shape)
                per_block[max(b for b, _ in where.values())] = ([], [])
            for b, (src, dst) in per_block.items():
                routes.setdefault((b, tuple(src), tuple(dst)), []).append((key, name))
        used = sorted({b for b, _, _ in routes})
        arg = {b: i for i, b in enumerate(used)}
        pieces = [Piece(arg[b], tuple(k for k, _ in cols), src, dst, tuple(n for _, n in cols))
                  for (b, src, dst), cols in routes.items()]
        return RowsSpec(len(positions), pieces, by_value, dict(self.info)), [self.blocks[b].ref for b in used]

    def store(self, rows: Batch) -> None:
        """Columns of every row (current order) read from the workers: the driver holds them from now on."""
        for key in rows.tensors.keys():
            self.table.set(key, rows[key])
        self.table.meta.update(rows.meta)

    # ------------------------------------------------------------------ adding and moving rows
    def add_blocks(self, refs: Sequence[Any], keys: Iterable[str], row_groups: Sequence[Sequence[int]],
                   tensor_keys: Iterable[str]) -> None:
        """Blocks `refs` (one per group of rows, positions in the current order) holding columns `keys`."""
        for ref, rows in zip(refs, row_groups):
            self.blocks.append(Block(ref, frozenset(keys), tuple(self.ids[p] for p in rows)))
        self._tensor_keys |= set(tensor_keys)
        for key in keys:  # a newer block column replaces what the driver held under that name (a row broadcast too)
            self._drop_driver_column(key)

    def _drop_driver_column(self, key: str) -> None:
        """Forget the driver's column `key` (its own tensor or meta, or a row broadcast of it): a block holds it now."""
        for name in (key, key + ROW_SUFFIX):
            self.table.tensors.pop(name, None)
        self.table.meta.pop(key, None)

    def update(self, other: StepData | Batch) -> StepData:
        """Add `other`'s columns (the same rows, in the same order); returns self."""
        if len(other) != len(self):
            raise ValueError(f"cannot merge {len(other)} rows into a step of {len(self)}")
        if isinstance(other, Batch):
            for key in other.tensors.keys():
                self.set(key, other[key])
            self.table.meta.update(other.meta)
            self.info.update(other.info)
            return self
        if other.ids != self.ids:
            raise ValueError("cannot merge a step's columns computed for other rows")
        self._tensor_keys |= other._tensor_keys
        for block in other.blocks:
            if block not in self.blocks:
                for key in block.keys:
                    self._drop_driver_column(key)
                self.blocks.append(block)
        self.update(other.table)
        return self

    def select_rows(self, index: Sequence[int] | torch.Tensor | slice) -> StepData:
        rows = list(range(len(self)))[index] if isinstance(index, slice) else [int(i) for i in index]
        out = StepData([self.ids[i] for i in rows], self.table.select_rows(rows), self.blocks, self._tensor_keys)
        out._derived, out._aliases = dict(self._derived), dict(self._aliases)  # builds are row-wise (`derive`)
        return out

    def copy(self) -> StepData:
        """Another view of the same rows whose driver columns can change independently."""
        table = Batch(self.table.tensors.clone(recurse=False), dict(self.table.meta), dict(self.info))
        out = StepData(self.ids, table, self.blocks, self._tensor_keys)
        out._derived, out._aliases = dict(self._derived), dict(self._aliases)
        return out

    @staticmethod
    def concat(parts: Sequence[StepData]) -> StepData:
        if not parts:
            raise ValueError("cannot concatenate an empty list of steps")
        carried = set.intersection(*(set(p._derived) for p in parts))  # every part builds it: the join builds it
        for p in parts:  # each part's other builds, before their tables are joined
            for key in [k for k in p._derived if k not in carried]:
                p[key]
        table = Batch.concat([p.table for p in parts]) if any(len(p.table.tensors.keys()) for p in parts) else \
            _empty(sum(len(p) for p in parts), {k: [x for p in parts for x in p.table.meta[k]] for k in parts[0].table.meta},
                   parts[0].info)
        blocks = [b for p in parts for b in p.blocks]
        out = StepData([i for p in parts for i in p.ids], table, blocks, set().union(*(p._tensor_keys for p in parts)))
        for p in parts:
            out._aliases.update(p._aliases)
        out._derived = {key: _joined_build([(p.ids, p._derived[key]) for p in parts]) for key in carried}
        return out


def _joined_build(builds: Sequence[tuple[Sequence[int], Callable[[StepData], torch.Tensor]]]
                  ) -> Callable[[StepData], torch.Tensor]:
    """The build of a column over rows of several steps (`concat`): each step's build (`derive`: row-wise) on
    its own rows, known by row id, in the order of the rows built."""
    def build(data: StepData) -> torch.Tensor:
        pieces, order = [], []
        for ids, part_build in builds:
            mine = set(ids)
            positions = [i for i, rid in enumerate(data.ids) if rid in mine]
            if positions:
                pieces.append(part_build(data.select_rows(positions)))
                order += positions
        if not pieces:  # no rows: any part's build gives the empty column
            return builds[0][1](data)
        return torch.cat(pieces)[torch.argsort(torch.tensor(order))]
    return build


def from_batch(batch: Batch) -> StepData:
    """Rows the driver made itself (prompts): every column held here."""
    return StepData(new_row_ids(len(batch)), batch)


def from_results(source: StepData | None, groups: Sequence[Sequence[int]], stays: Sequence[Any],
                 reports: Sequence[Batch], keys: Iterable[str], tensor_keys: Iterable[str]) -> StepData:
    """The step after a call: blocks `stays` (one per group of rows) and the groups' row reports.
    With a `source` the results are columns of its rows (positions `groups`); without, new rows."""
    table = Batch.concat(list(reports))
    if source is None:
        sizes = [len(r) for r in reports]
        starts = list(itertools.accumulate([0, *sizes]))
        groups = [range(a, a + n) for a, n in zip(starts, sizes)]
        data = StepData(new_row_ids(len(table)), _empty(len(table), info=table.info))
    else:
        if [p for g in groups for p in g] != list(range(len(source))):
            raise ValueError("call results must cover the step's rows in order (contiguous dp shards)")
        data = StepData(source.ids, _empty(len(source), info=table.info))
    data.add_blocks(stays, keys, groups, tensor_keys)
    data.update(table)  # the reported per-row values: held by the driver
    return data
