"""Split one ring-attention box into tiles a fused attention kernel computes without a mask.

A box (rlsp/parallel/ring_plan.py `StepBlock`) holds rows and keys of one segment only, each side a
few runs of consecutive stream positions (zigzag: at most the tail of chunk i and the head of chunk
2r-1-i), and key b is visible to row a iff pos(b) <= pos(a). For one run of rows and one run of keys
that visibility is exactly the union of:
- keys before the first row: visible to every row ("full" tile);
- the rows and keys sharing positions [s, e): a square, causal tile whose first row and first key
  sit at the same position, so top-left and bottom-right causal alignment agree (no kernel
  convention to mind);
- the rows after e and the keys [s, e): visible to every one of those rows ("full" tile).
Keys after the last row are invisible. So every box is covered exactly, with no fallback; neighbouring
full tiles that share their keys (or rows) and touch are merged to save kernel calls. Last, no tile
keeps more than MAX_TILE rows or keys: a kernel's buffers grow with its tile (on CUDA k/v are expanded
to the q heads over the tile's keys), so a long sequence's box, hundreds of thousands of tokens on a
rank, runs as a grid of bounded tiles — a causal square as causal squares on its diagonal and full tiles
below it — and the tiles' outputs merge by their log-sum-exp as every tile's do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TILE = 16384  # rows and keys per tile at most (the planner's rlsp.plan.memory.RING_TILE_TOKENS)


@dataclass(frozen=True)
class Tile:
    """Rows [q0, q1) x keys [k0, k1) of a rank's local tokens; causal tiles are square and diagonal."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def _runs(pos: list[int], first: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive positions -> (first index, end index, first position); indices from `first`."""
    runs, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            runs.append((first + start, first + i, pos[start]))
            start = i
    return runs


def _pair_tiles(rows: tuple[int, int, int], keys: tuple[int, int, int]) -> list[Tile]:
    """Tiles covering the visible pairs of one run of rows x one run of keys (module docstring)."""
    a0, a1, p0 = rows
    b0, b1, c0 = keys
    last = p0 + (a1 - a0) - 1  # position of the last row
    end = min(c0 + (b1 - b0), last + 1)  # keys past the last row are invisible
    if end <= c0:
        return []
    row_at, key_at = (lambda p: a0 + p - p0), (lambda p: b0 + p - c0)
    tiles = []
    if c0 < p0:  # keys before the first row
        tiles.append(Tile(a0, a1, b0, key_at(min(end, p0)), False))
    start = max(c0, p0)
    if start < end:
        tiles.append(Tile(row_at(start), row_at(end), key_at(start), key_at(end), True))
        if end <= last:
            tiles.append(Tile(row_at(end), a1, key_at(start), key_at(end), False))
    return tiles


def _merge_full(tiles: list[Tile]) -> list[Tile]:
    """Merge full tiles with equal keys and touching rows, or equal rows and touching keys."""
    out: list[Tile] = []
    for t in tiles:
        for i, u in enumerate(out):
            if u.causal or t.causal:
                continue
            if (u.k0, u.k1) == (t.k0, t.k1) and (u.q1 == t.q0 or t.q1 == u.q0):
                out[i] = Tile(min(u.q0, t.q0), max(u.q1, t.q1), u.k0, u.k1, False)
                break
            if (u.q0, u.q1) == (t.q0, t.q1) and (u.k1 == t.k0 or t.k1 == u.k0):
                out[i] = Tile(u.q0, u.q1, min(u.k0, t.k0), max(u.k1, t.k1), False)
                break
        else:
            out.append(t)
    return out


def _bounded(t: Tile, m: int) -> list[Tile]:
    """`t` as tiles of at most m rows and m keys covering the same pairs: a full tile as a grid, a causal
    square as causal squares on its diagonal and the full tiles below them."""
    if max(t.q1 - t.q0, t.k1 - t.k0) <= m:
        return [t]
    if not t.causal:
        return [Tile(a, min(a + m, t.q1), b, min(b + m, t.k1), False)
                for a in range(t.q0, t.q1, m) for b in range(t.k0, t.k1, m)]
    n, out = t.q1 - t.q0, []
    for i in range(0, n, m):
        end = min(i + m, n)
        out += [Tile(t.q0 + i, t.q0 + end, t.k0 + j, t.k0 + j + m, False) for j in range(0, i, m)]
        out.append(Tile(t.q0 + i, t.q0 + end, t.k0 + i, t.k0 + end, True))
    return out


def split_box(pos_Q: torch.Tensor, pos_K: torch.Tensor, q0: int, k0: int) -> tuple[Tile, ...]:
    """Tiles of a box whose rows (keys) start at local index q0 (k0) with increasing stream positions
    pos_Q (pos_K), all of one segment. Together they cover each visible pair exactly once; none holds
    more than MAX_TILE rows or keys."""
    rows, keys = _runs(pos_Q.tolist(), q0), _runs(pos_K.tolist(), k0)
    merged = _merge_full([t for r in rows for k in keys for t in _pair_tiles(r, k)])
    return tuple(b for t in merged for b in _bounded(t, MAX_TILE))
