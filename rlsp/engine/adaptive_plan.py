"""Adaptive sequence parallelism's plan: which rows run at which Ulysses degree, in which round, on
which sub-group of ranks (pure; every rank computes the same plan from the same row lengths).

A Ulysses group of G ranks runs rounds of micro-batches. A round has one degree d (a divisor of G):
its G / d sub-groups ("lanes") of d consecutive ranks each run one bin of rows, a bin holding at most
budget * d tokens. Each row runs at the smallest degree whose bin holds it (a row longer than
budget * G runs alone at the full degree, as a fixed degree would run it), so short rows skip the
head all-to-all and the per-rank sliver of a long one.

Every round ends with the slowest lane (FSDP's collectives run in step on every rank), so the plan
balances the work of the lanes, not only their tokens: a row's cost is its tokens plus attention's
quadratic part, `L + L^2 / quad_tokens`, where `quad_tokens` is the length at which a row's
attention work equals the rest of its layer work (`quadratic_tokens` derives it from the model
config). Per degree the rows go into as many rounds as first-fit decreasing needs for them (never
more rounds than a token-only plan), longest-processing-time first (each row into the lightest bin
with room for its tokens; first-fit's bins where that finds no room), and bins of similar cost share
a round, so the sum of the rounds' slowest lanes stays small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rlsp.data.balance import plan_token_bins

Rounds = list[tuple[int, list[list[int]]]]


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


def _degree_rounds(rows: list[int], lengths: Sequence[int], costs: list[float], capacity: int,
                   lanes: int) -> list[list[list[int]]]:
    """The rows of one degree as rounds of `lanes` bins each, as few rounds as hold them."""
    first_fit = plan_token_bins([lengths[i] for i in rows], capacity)
    num_bins = math.ceil(len(first_fit) / lanes) * lanes
    bins = _fill(rows, lengths, costs, capacity, num_bins)
    if bins is None:  # rarely LPT, which balances work first, packs worse: keep first-fit's rows per bin
        bins = [[rows[j] for j in b] for b in first_fit] + [[] for _ in range(num_bins - len(first_fit))]
    bins = sorted((sorted(b) for b in bins), key=lambda b: (-sum(costs[i] for i in b), b))
    return [bins[k:k + lanes] for k in range(0, len(bins), lanes)]


def plan_adaptive_rounds(lengths: Sequence[int], budget: int, group_size: int,
                         quad_tokens: float | None = None) -> Rounds:
    """Rounds of micro-batches for `group_size` ranks that share the rows `lengths` (tokens per row).

    Returns [(degree, [rows of lane 0, rows of lane 1, ...]), ...], degrees ascending; each lane's
    rows sorted; an empty list is a lane that idles through an empty micro-batch. Every row appears
    exactly once; the plan depends on `lengths` alone (deterministic on every rank)."""
    degree_of = row_degrees(lengths, budget, group_size)
    costs = [row_cost(n, quad_tokens) for n in lengths]
    rounds: Rounds = []
    for d in sorted(set(degree_of)):
        rows = [i for i, e in enumerate(degree_of) if e == d]
        rounds += [(d, chunk) for chunk in _degree_rounds(rows, lengths, costs, budget * d, group_size // d)]
    return rounds
