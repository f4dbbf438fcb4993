"""Head layout planner for Ulysses sequence parallelism: which attention heads each sp rank owns.

Inside attention every sp rank holds the full token stream for a subset of heads. Query heads are
split contiguously and as evenly as possible (sizes differ by at most one, so any sp works, also
when sp does not divide the head count); among such splits the one that sends the fewest kv
heads is chosen (range borders placed on GQA group borders where possible). Each rank receives exactly the key/value heads its query
heads read (GQA: query head h reads kv head h // group, group = q_heads // kv_heads). When
kv_heads >= sp and sp divides both counts this is a plain split; when kv_heads < sp a kv head is
sent to every rank whose query heads read it, i.e. replicated only as often as needed, never
expanded to the full query-head count.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadLayout:
    """Per-rank head ranges: rank r owns q heads [q_ranges[r]) and receives kv heads [kv_ranges[r])."""

    num_q_heads: int
    num_kv_heads: int
    sp_size: int
    q_ranges: tuple[tuple[int, int], ...]
    kv_ranges: tuple[tuple[int, int], ...]

    @property
    def group_size(self) -> int:
        """Query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads

    def q_count(self, rank: int) -> int:
        start, end = self.q_ranges[rank]
        return end - start

    def kv_count(self, rank: int) -> int:
        start, end = self.kv_ranges[rank]
        return end - start

    @property
    def q_counts(self) -> tuple[int, ...]:
        return tuple(self.q_count(r) for r in range(self.sp_size))

    @property
    def kv_counts(self) -> tuple[int, ...]:
        return tuple(self.kv_count(r) for r in range(self.sp_size))

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        """Ranks without any query head (only when num_q_heads < sp): they idle inside attention."""
        return tuple(r for r in range(self.sp_size) if self.q_count(r) == 0)

    @property
    def is_even(self) -> bool:
        """True when every rank owns the same number of q heads and of kv heads."""
        return len(set(self.q_counts)) == 1 and len(set(self.kv_counts)) == 1

    def kv_replication(self) -> float:
        """kv heads received over all ranks / num_kv_heads (1.0 = no replication)."""
        return sum(self.kv_counts) / self.num_kv_heads

    def extra_kv_heads(self) -> int:
        """kv heads received in excess of sending every kv head to exactly one rank."""
        return sum(self.kv_counts) - self.num_kv_heads

    def extra_kv_bytes(self, num_tokens: int, head_dim: int, bytes_per_elem: int) -> int:
        """Extra K and V bytes per layer (all ranks together) caused by kv replication, for a stream
        of `num_tokens` tokens, versus a layout that sends every kv head once."""
        return 2 * self.extra_kv_heads() * num_tokens * head_dim * bytes_per_elem

    def load_imbalance(self) -> float:
        """max / mean query heads per rank (1.0 = perfectly balanced attention work)."""
        return max(self.q_counts) * self.sp_size / self.num_q_heads

    def describe(self) -> str:
        """One line for logs and error messages."""
        return (
            f"{self.num_q_heads}q/{self.num_kv_heads}kv heads over sp={self.sp_size}: q per rank "
            f"{list(self.q_counts)}, kv per rank {list(self.kv_counts)}, kv replication "
            f"{self.kv_replication():.2f}x, load imbalance {self.load_imbalance():.2f}"
        )


def _check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; it must be an integer >= 1")


def _kv_needed(start: int, end: int, group: int) -> int:
    return (end - 1) // group - start // group + 1 if end > start else 0


def _balanced_sizes(num_q_heads: int, group: int, sp_size: int) -> list[int]:
    """Per-rank q-head counts, each floor or ceil of q/sp, ordered to minimise kv heads received.

    Which ranks get the extra head decides where range borders fall; a border inside a GQA group
    sends that group's kv head to two ranks. Dynamic programme over (rank, big ranks so far); the
    position of rank r's first head is r * base + bigs. Ties prefer big ranks first.
    """
    base, extra = divmod(num_q_heads, sp_size)
    inf = float("inf")
    # best[r][b]: min kv heads for ranks r.. given b big ranks among the first r
    best = [[inf] * (extra + 1) for _ in range(sp_size + 1)]
    best[sp_size][extra] = 0
    for r in range(sp_size - 1, -1, -1):
        for b in range(min(r, extra) + 1):
            pos = r * base + b
            if b < extra:
                best[r][b] = _kv_needed(pos, pos + base + 1, group) + best[r + 1][b + 1]
            if r - b < sp_size - extra:
                best[r][b] = min(best[r][b], _kv_needed(pos, pos + base, group) + best[r + 1][b])
    sizes, b = [], 0
    for r in range(sp_size):
        pos = r * base + b
        take_big = b < extra and best[r][b] == _kv_needed(pos, pos + base + 1, group) + best[r + 1][b + 1]
        sizes.append(base + 1 if take_big else base)
        b += int(take_big)
    return sizes


def plan_head_layout(num_q_heads: int, num_kv_heads: int, sp_size: int) -> HeadLayout:
    """Split heads over `sp_size` ranks (see the module docstring for the rules)."""
    _check_positive_int("num_q_heads", num_q_heads)
    _check_positive_int("num_kv_heads", num_kv_heads)
    _check_positive_int("sp_size", sp_size)
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            "grouped-query attention needs q_heads = group * kv_heads"
        )
    group = num_q_heads // num_kv_heads
    sizes = _balanced_sizes(num_q_heads, group, sp_size)
    q_ranges: list[tuple[int, int]] = []
    kv_ranges: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        end = start + size
        q_ranges.append((start, end))
        # A rank without q heads gets an empty kv range anchored where its q range would start.
        kv_ranges.append((start // group, (end - 1) // group + 1) if size else (start // group, start // group))
        start = end
    return HeadLayout(
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        sp_size=sp_size,
        q_ranges=tuple(q_ranges),
        kv_ranges=tuple(kv_ranges),
    )
