"""Token-budget bins and token-balanced dp shards."""

from __future__ import annotations

import random

import pytest

from rlsp.data.balance import balanced_order, count_token_bins, plan_token_bins


def test_bins_respect_the_budget_and_cover_every_row_once():
    rng = random.Random(0)
    lengths = [rng.randint(1, 30) for _ in range(40)]
    bins = plan_token_bins(lengths, 50)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 50 for b in bins)
    assert len(bins) == count_token_bins(lengths, 50) <= sum(lengths) // 50 + 2  # first-fit decreasing is tight here
    more = plan_token_bins(lengths, 50, num_bins=len(bins) + 5)
    assert len(more) == len(bins) + 5 and all(b for b in more)
    assert all(sum(lengths[i] for i in b) <= 50 for b in more)


def test_a_row_longer_than_the_budget_gets_its_own_bin_and_bad_counts_are_refused():
    assert plan_token_bins([100, 3, 4], 10) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="num_bins=1 must be in \\[2, 3\\]"):
        plan_token_bins([100, 3, 4], 10, num_bins=1)
    with pytest.raises(ValueError, match="token budget must be >= 1"):
        count_token_bins([1], 0)


def test_balanced_order_evens_out_token_totals():
    lengths = [40, 1, 38, 2, 35, 3, 30, 5]  # contiguous halves would be 81 vs 73 -> badly split as sorted
    order = balanced_order(sorted(lengths, reverse=True), 2)
    chunk = [sorted(lengths, reverse=True)[i] for i in order]
    assert sorted(order) == list(range(8))
    assert abs(sum(chunk[:4]) - sum(chunk[4:])) <= 4
    with pytest.raises(ValueError, match="cannot balance 8 rows over 3 equal parts"):
        balanced_order(lengths, 3)


def test_degree_rounds_put_every_row_once_at_its_smallest_degree():
    from rlsp.data.balance import plan_degree_rounds

    lengths = [3, 40, 9, 17, 5, 2, 30, 8, 1, 70]
    budget, group = 10, 4
    rounds = plan_degree_rounds(lengths, budget, group)
    seen = sorted(i for _, bins in rounds for b in bins for i in b)
    assert seen == list(range(len(lengths)))
    for degree, bins in rounds:
        assert len(bins) == group // degree and group % degree == 0
        for b in bins:
            assert len(b) == 1 or sum(lengths[i] for i in b) <= budget * degree
            for i in b:  # the smallest degree that holds the row (or the full one for an over-long row)
                smallest = next((d for d in (1, 2, 4) if lengths[i] <= budget * d), 4)
                assert degree == smallest, (i, lengths[i], degree)
    assert [d for d, _ in rounds] == sorted(d for d, _ in rounds)
    # first-fit decreasing at each degree; a round's spare sub-groups idle
    assert rounds == [(1, [[2, 8], [5, 7], [0, 4], []]), (2, [[3], []]), (4, [[9]]), (4, [[1]]), (4, [[6]])]
