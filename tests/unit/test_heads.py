"""Head layout planner: every q head exactly once, kv ranges = exactly the kv heads read, costs."""

from __future__ import annotations

import itertools

import pytest

from rlsp.parallel.heads import HeadLayout, plan_head_layout

CASES = [(4, 2, 4), (8, 4, 2), (6, 2, 4), (28, 4, 8), (40, 8, 16), (7, 7, 2), (2, 1, 4), (40, 8, 5)]


def _check_layout(layout: HeadLayout) -> None:
    q, kv, sp = layout.num_q_heads, layout.num_kv_heads, layout.sp_size
    group = q // kv
    covered = [h for start, end in layout.q_ranges for h in range(start, end)]
    assert covered == list(range(q))  # contiguous, in rank order, each head once
    counts = layout.q_counts
    assert max(counts) - min(counts) <= 1
    for rank in range(sp):
        qs, qe = layout.q_ranges[rank]
        needed = sorted({h // group for h in range(qs, qe)})
        ks, ke = layout.kv_ranges[rank]
        assert list(range(ks, ke)) == needed, (rank, layout.kv_ranges[rank], needed)


@pytest.mark.parametrize("q,kv,sp", CASES)
def test_layout_covers_heads_and_needed_kv(q: int, kv: int, sp: int) -> None:
    _check_layout(plan_head_layout(q, kv, sp))


def test_known_layouts() -> None:
    kv_lt_sp = plan_head_layout(4, 2, 4)
    assert kv_lt_sp.kv_ranges == ((0, 1), (0, 1), (1, 2), (1, 2))
    assert kv_lt_sp.kv_replication() == 2.0 and kv_lt_sp.load_imbalance() == 1.0 and kv_lt_sp.is_even
    plain = plan_head_layout(8, 4, 2)
    assert plain.q_ranges == ((0, 4), (4, 8)) and plain.kv_ranges == ((0, 2), (2, 4))
    assert plain.extra_kv_heads() == 0 and plain.extra_kv_bytes(100, 64, 2) == 0
    uneven = plan_head_layout(6, 2, 4)
    # borders on GQA group borders: [2, 1 | 2, 1] sends 4 kv heads, the naive [2, 2, 1, 1] would send 5
    assert uneven.q_ranges == ((0, 2), (2, 3), (3, 5), (5, 6))
    assert uneven.kv_ranges == ((0, 1), (0, 1), (1, 2), (1, 2))
    assert uneven.extra_kv_heads() == 2
    assert uneven.extra_kv_bytes(num_tokens=10, head_dim=8, bytes_per_elem=4) == 2 * 2 * 10 * 8 * 4
    assert uneven.load_imbalance() == pytest.approx(2 / 1.5)
    odd = plan_head_layout(7, 7, 2)
    assert odd.q_ranges == ((0, 4), (4, 7)) and odd.kv_ranges == odd.q_ranges
    assert odd.load_imbalance() == pytest.approx(8 / 7) and not odd.is_even


def test_qwen14b_shape_all_sp_legal() -> None:
    """40 q / 8 kv heads: every sp works; kv replicated only when kv < sp, never to q-head count."""
    for sp in (1, 2, 3, 4, 5, 6, 8, 10, 16, 40):
        layout = plan_head_layout(40, 8, sp)
        _check_layout(layout)
        assert sum(layout.kv_counts) <= max(8, sp) + sp - 1  # a kv head crosses at most sp-1 rank borders
    assert plan_head_layout(40, 8, 16).kv_counts == (1,) * 16  # 2.5 q heads per rank, one kv head each


@pytest.mark.parametrize("q,kv,sp", [(6, 2, 4), (10, 2, 4), (40, 8, 6), (40, 8, 16), (12, 4, 5), (9, 3, 7), (7, 1, 3)])
def test_kv_heads_received_is_minimal_over_balanced_splits(q: int, kv: int, sp: int) -> None:
    """Brute force over every placement of the larger ranks: the planner sends the fewest kv heads."""
    group, (base, extra) = q // kv, divmod(q, sp)
    best = None
    for bigs in itertools.combinations(range(sp), extra):
        total, start = 0, 0
        for rank in range(sp):
            end = start + base + (rank in bigs)
            total += (end - 1) // group - start // group + 1 if end > start else 0
            start = end
        best = total if best is None else min(best, total)
    assert sum(plan_head_layout(q, kv, sp).kv_counts) == best


def test_fewer_q_heads_than_sp_reports_idle_ranks() -> None:
    layout = plan_head_layout(2, 1, 4)
    assert layout.q_counts == (1, 1, 0, 0) and layout.idle_ranks == (2, 3)
    assert layout.kv_counts == (1, 1, 0, 0) and layout.load_imbalance() == 2.0
    assert "sp=4" in layout.describe()


@pytest.mark.parametrize(
    "args,match",
    [((6, 4, 2), "not a multiple"), ((0, 1, 1), "num_q_heads"), ((4, 0, 1), "num_kv_heads"), ((4, 2, 0), "sp_size")],
)
def test_rejects_invalid(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_head_layout(*args)
