"""Adaptive sequence parallelism's plan: which rows run at which Ulysses degree, in which round, on
which sub-group of ranks (pure; every rank computes the same plan from the same row lengths).

A Ulysses group of G ranks runs rounds of micro-batches. In a round each rank belongs to one lane:
d consecutive ranks (d a divisor of G, the lane starting at a multiple of d: a sub-group of
rlsp.parallel.mesh) that run one bin of rows at Ulysses degree d, a bin holding at most budget * d
tokens. Each row runs at the smallest degree whose bin holds it (a row longer than budget * G runs
alone at the full degree, as a fixed degree would run it), so short rows skip the head all-to-all
and the per-rank sliver of a long one. A round may mix degrees: the ranks a degree-2 lane leaves
free in a group of 4 run short rows at degree 1 instead of idling.

Every round ends with the slowest lane (FSDP's collectives run in step on every rank), so the plan
balances the work of the lanes, not only their tokens: a row's cost is its tokens plus attention's
quadratic part, `L + L^2 / quad_tokens`, where `quad_tokens` is the length at which a row's
attention work equals the rest of its layer work (`quadratic_tokens` derives it from the model
config). Each degree gets the bins first-fit decreasing needs for its rows, placed widest first into
the first round with a free aligned block (so never more rounds than a plan of one degree per
round); blocks still free become extra bins of the smallest degrees. The rows of a degree then go
longest-processing-time first into the lightest of its bins with room for their tokens (first-fit's
bins where that finds no room), and the heaviest bins take the earliest slots, so bins of similar
work share a round and the sum of the rounds' slowest lanes stays small.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlsp.data.balance import plan_token_bins

Lane = tuple[int, list[int]]  # (degree, rows) of d consecutive ranks
Rounds = list[list[Lane]]  # per round, its lanes in rank order


def quadratic_tokens(config: Any) -> float | None:
    """Row length at which causal attention's FLOPs equal those of the layer's matmuls, from a decoder
    config (hidden_size, intermediate_size, heads, head_dim); None when the config lacks them.

    Per token and layer the projections cost 2 * hidden * (2 * q_dim + 2 * kv_dim) and the gated MLP
    2 * 3 * hidden * intermediate FLOPs; attention costs 4 * q_dim per (query, key) pair, and a row
    of L tokens has about L^2 / 2 causal pairs. Setting L * linear == L^2 / 2 * 4 * q_dim gives
    L = linear / (2 * q_dim)."""
    try:
        hidden, inter = int(config.hidden_size), int(config.intermediate_size)
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    except (AttributeError, TypeError):
        return None
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    linear = 2 * hidden * (2 * q_dim + 2 * kv_dim) + 6 * hidden * inter
    return linear / (2 * q_dim)


def row_cost(length: int, quad_tokens: float | None) -> float:
    """Relative work of a row of `length` tokens: its tokens plus attention's quadratic part."""
    return float(length) if not quad_tokens else length + length * length / quad_tokens


def row_degrees(lengths: Sequence[int], budget: int, group_size: int) -> list[int]:
    """Each row's Ulysses degree: the smallest divisor d of `group_size` with length <= budget * d (the
    full degree for a row longer than any bin)."""
    if budget < 1 or group_size < 1:
        raise ValueError(f"adaptive plan needs budget >= 1 and group_size >= 1, got {budget}, {group_size}")
    degrees = [d for d in range(1, group_size + 1) if group_size % d == 0]
    return [next((d for d in degrees if n <= budget * d), group_size) for n in lengths]


def _fill(rows: list[int], lengths: Sequence[int], costs: list[float], capacity: int,
          num_bins: int) -> list[list[int]] | None:
    """Longest-processing-time first into `num_bins` bins of <= `capacity` tokens (a row longer than a
    bin takes an empty one); None when some row finds no bin with room."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    load, work = [0] * num_bins, [0.0] * num_bins
    for i in sorted(rows, key=lambda r: (-costs[r], -lengths[r], r)):
        room = [b for b in range(num_bins) if load[b] + lengths[i] <= capacity or not bins[b]]
        if not room:
            return None
        b = min(room, key=lambda k: (work[k], load[k], k))
        bins[b].append(i)
        load[b] += lengths[i]
        work[b] += costs[i]
    return bins


def _claim(free: list[list[bool]], d: int, group_size: int, grow: bool) -> tuple[int, int] | None:
    """The first round's free block of d ranks at an offset divisible by d (a sub-group of mesh.py),
    the highest such block of that round (wide lanes gather at the group's end, short rows at its
    start), marked taken: (round, offset); in a new round when none is free and `grow`, else None."""
    for r, slots in enumerate(free):
        for off in range(group_size - d, -1, -d):
            if all(slots[off:off + d]):
                slots[off:off + d] = [False] * d
                return r, off
    if not grow:
        return None
    free.append([True] * (group_size - d) + [False] * d)
    return len(free) - 1, group_size - d


def _slots(rows_of: dict[int, list[int]], lengths: Sequence[int], budget: int,
           group_size: int) -> tuple[dict[int, list[tuple[int, int]]], list[list[bool]]]:
    """Where each degree's bins run, as (round, first rank): first-fit's bin count per degree, widest
    lanes first (aligned first-fit into rounds, so short rows fill the ranks a long row's round
    leaves idle), then blocks still idle become extra, lighter bins of the smallest degrees."""
    free: list[list[bool]] = []
    slots: dict[int, list[tuple[int, int]]] = {d: [] for d in rows_of}
    for d in sorted(rows_of, reverse=True):
        for _ in plan_token_bins([lengths[i] for i in rows_of[d]], budget * d):
            slots[d].append(_claim(free, d, group_size, grow=True) or (0, 0))  # grow: always a block
    for d in sorted(rows_of):
        while len(slots[d]) < len(rows_of[d]) and (slot := _claim(free, d, group_size, grow=False)) is not None:
            slots[d].append(slot)
    return slots, free


def _bins(rows: list[int], lengths: Sequence[int], costs: list[float], capacity: int,
          num_bins: int) -> list[list[int]]:
    """The rows of one degree in `num_bins` bins, LPT-balanced (first-fit's bins where LPT, which
    balances work first, finds no room), heaviest first, each sorted."""
    bins = _fill(rows, lengths, costs, capacity, num_bins)
    if bins is None:
        first_fit = plan_token_bins([lengths[i] for i in rows], capacity)
        bins = [[rows[j] for j in b] for b in first_fit] + [[] for _ in range(num_bins - len(first_fit))]
    return sorted((sorted(b) for b in bins), key=lambda b: (-sum(costs[i] for i in b), b))


def plan_adaptive_rounds(lengths: Sequence[int], budget: int, group_size: int,
                         quad_tokens: float | None = None) -> Rounds:
    """Rounds of micro-batches for `group_size` ranks that share the rows `lengths` (tokens per row).

    Returns one list per round of its lanes in rank order, (degree, rows) each, rows sorted, the
    degrees summing to `group_size`; a lane (1, []) idles through an empty micro-batch. A round may
    mix degrees. Every row appears exactly once; the plan depends on `lengths` alone (deterministic on
    every rank)."""
    degree_of = row_degrees(lengths, budget, group_size)
    costs = [row_cost(n, quad_tokens) for n in lengths]
    rows_of = {d: [i for i, e in enumerate(degree_of) if e == d] for d in sorted(set(degree_of))}
    slots, free = _slots(rows_of, lengths, budget, group_size)
    grid: list[dict[int, Lane]] = [{} for _ in free]
    for d, rows in rows_of.items():
        # heaviest bins into the earliest slots: bins of similar work share a round
        for (r, off), b in zip(sorted(slots[d]), _bins(rows, lengths, costs, budget * d, len(slots[d]))):
            grid[r][off] = (d, b)
    for r, taken in enumerate(free):
        grid[r].update({off: (1, []) for off, idle in enumerate(taken) if idle})
    return [[lanes[off] for off in sorted(lanes)] for lanes in grid]
