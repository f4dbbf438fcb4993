"""Token-budget micro-batching and token-balanced dp shards (pure; no torch.distributed here).

`plan_token_bins` packs rows into micro-batches whose token totals stay within a budget (first-fit
decreasing), into exactly `num_bins` bins when asked (so every rank runs the same number of
micro-batches, as FSDP's collectives require). `plan_degree_rounds` does the same for a group of
ranks that may split a micro-batch over fewer of them (adaptive sequence parallelism).
`balanced_order` permutes rows so that the `parts` equal contiguous chunks a dispatch makes have
nearly equal token totals.
"""

from __future__ import annotations

from collections.abc import Sequence


def count_token_bins(lengths: Sequence[int], budget: int) -> int:
    """Bins first-fit decreasing needs for `lengths` under `budget` (a longer row gets a bin of its own)."""
    return len(_ffd(lengths, budget))


def _ffd(lengths: Sequence[int], budget: int) -> list[list[int]]:
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def plan_token_bins(lengths: Sequence[int], budget: int, num_bins: int | None = None) -> list[list[int]]:
    """Row indices per micro-batch (each sorted ascending), totals within `budget` where possible.

    With `num_bins` (>= the count `count_token_bins` gives, <= number of rows) the heaviest bins are
    split until there are exactly that many; splitting never exceeds the budget.
    """
    bins = _ffd(lengths, budget)
    if num_bins is not None:
        if not len(bins) <= num_bins <= len(lengths):
            raise ValueError(f"num_bins={num_bins} must be in [{len(bins)}, {len(lengths)}] for {len(lengths)} rows")
        while len(bins) < num_bins:  # some bin has 2+ rows, since num_bins <= rows
            heavy = max((b for b in bins if len(b) > 1), key=lambda b: sum(lengths[i] for i in b))
            bins.remove(heavy)
            bins += [heavy[0::2], heavy[1::2]]
    return [sorted(b) for b in sorted(bins, key=min)]


def plan_degree_rounds(lengths: Sequence[int], budget: int, group_size: int) -> list[tuple[int, list[list[int]]]]:
    """Rounds of micro-batches for `group_size` ranks that share the rows `lengths`.

    A round runs at one degree d (a divisor of group_size): its group_size / d sub-groups of d
    consecutive ranks each take one bin of rows (an empty list: that sub-group idles through an empty
    micro-batch), a bin holding at most budget * d tokens. Each row goes to the smallest degree whose
    bin holds it (a row longer than budget * group_size runs alone at the full degree, as a fixed
    degree would run it), so short rows skip the head exchange and the per-rank sliver of a long one.
    Returns [(degree, [rows of sub-group 0, rows of sub-group 1, ...]), ...], degrees ascending.
    """
    degrees = [d for d in range(1, group_size + 1) if group_size % d == 0]
    by_degree: dict[int, list[int]] = {d: [] for d in degrees}
    for i, n in enumerate(lengths):
        by_degree[next((d for d in degrees if n <= budget * d), group_size)].append(i)
    rounds: list[tuple[int, list[list[int]]]] = []
    for d in degrees:
        rows = by_degree[d]
        if not rows:
            continue
        bins = [sorted(rows[j] for j in b) for b in _ffd([lengths[i] for i in rows], budget * d)]
        lanes = group_size // d
        for k in range(0, len(bins), lanes):
            chunk = bins[k:k + lanes]
            rounds.append((d, chunk + [[] for _ in range(lanes - len(chunk))]))
    return rounds


def balanced_order(lengths: Sequence[int], parts: int) -> list[int]:
    """A permutation of the rows such that `parts` equal contiguous chunks have near-equal token sums
    (greedy: longest row first, into the lightest part that still has room)."""
    n = len(lengths)
    if parts < 1 or n % parts:
        raise ValueError(f"cannot balance {n} rows over {parts} equal parts")
    size = n // parts
    members: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(n), key=lambda r: (-lengths[r], r)):
        p = min((q for q in range(parts) if len(members[q]) < size), key=lambda q: (loads[q], q))
        members[p].append(i)
        loads[p] += lengths[i]
    return [i for m in members for i in sorted(m)]
