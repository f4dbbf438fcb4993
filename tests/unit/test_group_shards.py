"""Shards of whole prompt groups when no equal cut holds them (rlsp.step.stage_advantages.group_shards, stage_shards)
and the dispatch that sends a BY_DP call's rows in shards of given row counts (rlsp.controller.worker_group.
dp_row_ranges; an empty shard's columns: rlsp.controller.step_data.StepData.spec). The stage's numbers on such
shards: tests/distributed/test_uneven_group_shards.py."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from rlsp.config.schema import RLSPConfig
from rlsp.controller.step_data import Block, StepData, new_row_ids
from rlsp.controller.worker_group import RayWorkerGroup, dp_row_ranges
from rlsp.data.batch import Batch
from rlsp.step.stage_advantages import group_shards, stage_shards
from rlsp.workers.columns import assemble

THREE_OF_FOUR = [f"p{i % 3}" for i in range(12)]  # 3 groups of 4, a group's rows apart (as after balancing)


def _check_whole(uids: list[str], order: list[int], sizes: list[int]) -> None:
    """`order` is a permutation whose contiguous shards of `sizes` rows hold whole groups, rows in the step's order."""
    assert sorted(order) == list(range(len(uids))) and sum(sizes) == len(uids)
    starts = list(itertools.accumulate(sizes, initial=0))
    shards = [order[a:a + n] for a, n in zip(starts, sizes)]
    for shard in shards:
        assert shard == sorted(shard)
    shard_of = {uids[r]: s for s, shard in enumerate(shards) for r in shard}
    assert all(uids[r] in shard_of and shard_of[uids[r]] == s for s, shard in enumerate(shards) for r in shard)
    assert len(shard_of) == len(set(uids))


def test_three_groups_of_four_over_two_ranks():
    order, sizes = group_shards(THREE_OF_FOUR, 2)
    assert sizes == [8, 4] and order == [0, 2, 3, 5, 6, 8, 9, 11, 1, 4, 7, 10]  # p0 and p2, then p1
    _check_whole(THREE_OF_FOUR, order, sizes)
    back = sorted(range(12), key=order.__getitem__)  # how the driver puts the call's columns back
    assert [order[b] for b in back] == list(range(12))


def test_fewer_groups_than_ranks_leave_a_rank_without_rows():
    assert group_shards(["p0"] * 4, 2) == ([0, 1, 2, 3], [4, 0])
    assert group_shards(["a", "b", "a", "b"], 4) == ([0, 2, 1, 3], [2, 2, 0, 0])
    with pytest.raises(ValueError, match="parts=0"):
        group_shards(["a"], 0)


@pytest.mark.parametrize("groups,parts,size", [(g, p, s) for g in range(1, 8) for p in (2, 3, 4) for s in (1, 3, 4)])
def test_equal_groups_are_cut_as_evenly_as_whole_groups_allow(groups: int, parts: int, size: int):
    uids = [f"p{i % groups}" for i in range(groups * size)]
    order, sizes = group_shards(uids, parts)
    _check_whole(uids, order, sizes)
    assert sizes == [size * (groups // parts + (p < groups % parts)) for p in range(parts)]


def test_unequal_groups_reach_the_most_even_cut_here():
    uids = ["a"] * 5 + ["b"] * 3 + ["c"] * 2 + ["d"] * 2  # 12 rows: no cut holds 6 and 6
    order, sizes = group_shards(uids, 2)
    _check_whole(uids, order, sizes)
    lengths = [5, 3, 2, 2]
    best = min(max(sum(n for n, side in zip(lengths, sides) if side), sum(n for n, side in zip(lengths, sides) if not side))
               for sides in itertools.product((0, 1), repeat=4))
    assert max(sizes) == best == 7


def test_the_stage_cuts_unequal_shards_only_when_no_equal_cut_exists():
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator, cfg.algorithm.use_kl_in_reward = "grpo", True
    rows = Batch.from_dict({"response_mask": torch.ones(12, 2)}, meta={"uid": THREE_OF_FOUR})
    assert stage_shards(rows, cfg, 2) == group_shards(THREE_OF_FOUR, 2)
    order, shards = stage_shards(rows, cfg, 3)  # one group a rank: equal chunks after reordering
    assert shards is None and [THREE_OF_FOUR[r] for r in order] == sorted(THREE_OF_FOUR)
    cfg.algorithm.adv_estimator = "gae"  # no groups read: the step's own equal chunks
    assert stage_shards(rows, cfg, 2) == (list(range(12)), None)


def test_dispatch_ranges_of_given_row_counts():
    assert dp_row_ranges(12, 2) == [range(0, 6), range(6, 12)]
    assert dp_row_ranges(12, 2, [8, 4]) == [range(0, 8), range(8, 12)]
    assert dp_row_ranges(4, 2, [4, 0]) == [range(0, 4), range(4, 4)]
    with pytest.raises(ValueError, match="cannot split a batch of 12 rows into 5 equal chunks"):
        dp_row_ranges(12, 5)
    for bad in ([8, 3], [12], [13, -1]):
        with pytest.raises(ValueError, match=re.escape(f"shards={bad}: need 2 row counts (one per dp group, each >= 0) "
                                                       "summing to the call's 12 rows")):
            dp_row_ranges(12, 2, bad)


def test_shards_are_refused_for_calls_every_rank_runs_alike():
    group = RayWorkerGroup.__new__(RayWorkerGroup)
    group.roles, group.group = ["actor"], "policy"
    with pytest.raises(ValueError, match=r"shards=\[1, 1\] given to actor.save_checkpoint.*Dispatch.ALL"):
        group.submit("actor", "save_checkpoint", "/tmp/x", shards=[1, 1])


def test_an_empty_shard_gets_every_column_with_no_rows():
    ids = new_row_ids(4)
    table = Batch(TensorDict({"row_reward": torch.arange(4.0)}, batch_size=[4]), {"uid": list("aabb")}, {})
    data = StepData(ids, table, tensor_keys={"old_logprobs"})
    held = Batch.from_dict({"old_logprobs": torch.zeros(4, 5, dtype=torch.float64)})
    data.blocks.append(Block(held, frozenset({"old_logprobs"}), tuple(ids)))
    spec, refs = data.spec([], ("old_logprobs", "row_reward", "uid"))
    rows = assemble(spec, refs)
    assert len(rows) == 0 and rows.meta["uid"] == [] and rows["row_reward"].shape == (0,)
    assert rows["old_logprobs"].shape == (0, 5) and rows["old_logprobs"].dtype == torch.float64
