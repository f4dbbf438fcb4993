"""Adaptive sequence parallelism's round plan: degrees per row, work-balanced lanes, every row exactly
once, token budgets kept, no more rounds than a token-only first-fit plan, deterministic."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from rlsp.data.balance import count_token_bins, plan_degree_rounds
from rlsp.engine.adaptive_plan import plan_adaptive_rounds, quadratic_tokens, row_cost, row_degrees


def _qwen_like(**extra):
    return SimpleNamespace(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                           **extra)


def test_quadratic_tokens_equates_attention_and_matmul_flops():
    # hidden 256, 8 q heads / 4 kv heads of 32: per token q 2*256*256, k and v 2*256*128 each,
    # o 2*256*256, MLP 3 * 2*256*512 FLOPs = 1,179,648; attention 2*256 (QK) + 2*256 (PV) = 1024
    # FLOPs per causal pair, L^2/2 pairs: L * 1,179,648 = L^2 / 2 * 1024  ->  L = 2304.
    linear = 2 * 256 * 256 + 2 * (2 * 256 * 128) + 2 * 256 * 256 + 3 * (2 * 256 * 512)
    assert linear == 1_179_648
    assert quadratic_tokens(_qwen_like()) == pytest.approx(2304.0, abs=0)
    # an explicit head_dim (64, not 256 / 8) sets the q / kv widths: q 512, kv 256
    linear64 = 2 * 256 * 512 * 2 + 2 * 256 * 256 * 2 + 6 * 256 * 512
    assert quadratic_tokens(_qwen_like(head_dim=64)) == pytest.approx(linear64 / (2 * 512), abs=0)
    assert quadratic_tokens(SimpleNamespace(hidden_size=256)) is None  # not a decoder config: tokens only


def test_row_cost_and_degrees():
    assert row_cost(100, None) == 100.0
    assert row_cost(100, 2304.0) == pytest.approx(100 + 10_000 / 2304.0, rel=1e-15)
    # group 4, budget 5: <= 5 tokens at 1, <= 10 at 2, <= 20 at 4, longer rows at the full degree 4
    assert row_degrees([5, 6, 10, 11, 20, 21], 5, 4) == [1, 2, 2, 4, 4, 4]
    assert row_degrees([4, 5, 9], 4, 3) == [1, 3, 3]  # group 3: degrees 1 and 3 only
    with pytest.raises(ValueError, match="budget >= 1"):
        row_degrees([1], 0, 2)


def test_lanes_balanced_by_work_where_first_fit_stacks_them():
    # budget 10, group 2, all rows at degree 1: first-fit makes 3 bins of 10 tokens -> 2 rounds.
    # LPT over 2 rounds x 2 lanes: 9 | 8 | 7 | 3+2+1; the two heaviest bins share a round.
    rounds = plan_adaptive_rounds([9, 8, 7, 3, 2, 1], 10, 2)
    assert rounds == [[(1, [0]), (1, [1])], [(1, [2]), (1, [3, 4, 5])]]
    slowest = sum(max(sum([9, 8, 7, 3, 2, 1][i] for i in rows) for _, rows in lanes) for lanes in rounds)
    assert slowest == 9 + 7  # the token-only plan's rounds end at 10 + 10
    assert plan_degree_rounds([9, 8, 7, 3, 2, 1], 10, 2) == [(1, [[0, 5], [1, 4]]), (1, [[2, 3], []])]  # 10 | 10, 10 | -


def test_quadratic_part_moves_a_long_row_away_from_short_ones():
    # budget 100, group 2, one round. Tokens alone (LPT): 60 | 20, 20, 20, then the last 20 joins the
    # 60 on the tie -> lanes of 80 and 60 tokens. With the quadratic part (quad_tokens 50: a 60-token
    # row costs 60 + 3600/50 = 132, a 20-token one 28) the 60 row runs alone (132) and the four short
    # rows share the other lane (112), where the token-only lanes would cost 132 + 28 = 160 and 84.
    lengths = [60, 20, 20, 20, 20]
    assert [row_cost(n, 50.0) for n in lengths] == pytest.approx([132.0, 28.0, 28.0, 28.0, 28.0], abs=1e-12)
    assert plan_adaptive_rounds(lengths, 100, 2) == [[(1, [0, 4]), (1, [1, 2, 3])]]
    assert plan_adaptive_rounds(lengths, 100, 2, quad_tokens=50.0) == [[(1, [0]), (1, [1, 2, 3, 4])]]


def test_first_fit_bins_kept_where_balancing_finds_no_room():
    # budget 10, one round of 2 lanes holds [5, 5] and [4, 3, 3] (first-fit); LPT's lightest-bin
    # choice would leave no room for the last 3, so first-fit's bins are kept: still one round.
    rounds = plan_adaptive_rounds([5, 5, 4, 3, 3], 10, 2)
    assert rounds == [[(1, [0, 1]), (1, [2, 3, 4])]]


def test_over_long_row_runs_alone_at_full_degree():
    # budget 5, group 2: 3 and 4 at degree 1 (one lane each, 7 > 5); 9 at degree 2; 25 > 5 * 2 runs
    # alone at the full degree too, in a round of its own; the widest lanes are placed first, and
    # within a degree the heavier bins take the earlier rounds
    rounds = plan_adaptive_rounds([25, 3, 9, 4], 5, 2)
    assert rounds == [[(2, [0])], [(2, [2])], [(1, [3]), (1, [1])]]


def test_short_rows_fill_the_ranks_a_long_rows_round_leaves_free():
    # group 4, budget 5: the 8-token row runs at degree 2 on ranks 2-3 (wide lanes take the group's
    # highest free block); the two 5-token rows run at degree 1 on ranks 0 and 1 of the same round:
    # one round, where one degree per round takes two (5 | 5 | idle | idle, then 8 | idle)
    assert plan_adaptive_rounds([8, 5, 5], 5, 4) == [[(1, [1]), (1, [2]), (2, [0])]]
    assert plan_degree_rounds([8, 5, 5], 5, 4) == [(1, [[1], [2], [], []]), (2, [[0], []])]
    # two 8-token rows take ranks 0-1 and 2-3; the 5-token row runs in a round of its own, on rank 3
    assert plan_adaptive_rounds([8, 8, 5], 5, 4) == [[(2, [0]), (2, [1])], [(1, []), (1, []), (1, []), (1, [2])]]


@pytest.mark.parametrize("seed,group,quad", [(0, 2, None), (1, 2, 2304.0), (2, 4, 500.0), (3, 8, None)])
def test_random_mixes_every_row_once_within_budget_no_extra_rounds(seed, group, quad):
    rng = random.Random(seed)
    budget = 1024
    lengths = [rng.randint(40, 250) for _ in range(40)] + [rng.randint(1000, budget * group + 300) for _ in range(6)]
    rounds = plan_adaptive_rounds(lengths, budget, group, quad)
    assert rounds == plan_adaptive_rounds(list(lengths), budget, group, quad)  # same lengths, same plan
    seen = sorted(i for lanes in rounds for _, rows in lanes for i in rows)
    assert seen == list(range(len(lengths)))  # every row exactly once
    degrees = row_degrees(lengths, budget, group)
    for lanes in rounds:
        first = 0
        for d, rows in lanes:
            assert first % d == 0  # a lane is one of mesh.py's sub-groups: d consecutive ranks from a multiple of d
            assert rows == sorted(rows) and all(degrees[i] == d for i in rows)
            assert sum(lengths[i] for i in rows) <= budget * d or len(rows) == 1
            first += d
        assert first == group  # the lanes cover the group's ranks once
    # never more rounds than one degree per round (first-fit decreasing's bins, rounded up to full rounds)
    uniform = sum(math.ceil(count_token_bins([lengths[i] for i in range(len(lengths)) if degrees[i] == d],
                                             budget * d) / (group // d)) for d in set(degrees))
    assert len(rounds) <= uniform
    assert len(rounds) <= len(plan_degree_rounds(lengths, budget, group))


def test_degree_one_lanes_balanced_on_the_benchmark_mix():
    # the short rows of benchmarks/adaptive_sp.py (prompt 32 included), budget 1024, group 2
    short = [116, 151, 125, 72, 75, 131, 139, 175, 209, 155, 93, 218, 108, 191, 110, 128, 128, 180, 226, 105,
             78, 111, 223, 86, 96, 153, 141, 161]
    lengths = short + [1981, 1912, 1913, 1744]
    rounds = plan_adaptive_rounds(lengths, 1024, 2, 2304.0)
    # the long rows' rounds first (widest lanes are placed first), one long row each
    assert [[(d, [lengths[i] for i in rows]) for d, rows in lanes] for lanes in rounds[:4]] == [
        [(2, [1981])], [(2, [1913])], [(2, [1912])], [(2, [1744])]]
    ones = rounds[4:]
    assert len(ones) == 2 and all(d == 1 for lanes in ones for d, _ in lanes)
    tokens = [sum(lengths[i] for i in rows) for lanes in ones for _, rows in lanes]
    assert sum(tokens) == sum(short)
    # LPT bound: no lane exceeds the mean lane by more than the longest short row (226 tokens); here
    # the lanes are within 10 tokens of each other, where first-fit's were 1017, 1015, 1023, 829
    assert max(tokens) - min(tokens) <= 10
    per_rank = [sum(lengths[i] for lanes in ones for i in lanes[r][1]) for r in range(2)]
    assert abs(per_rank[0] - per_rank[1]) <= 10
