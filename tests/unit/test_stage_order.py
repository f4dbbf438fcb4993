"""How the driver cuts a step's rows for the workers' advantages (rlsp.step.stage_advantages.stage_shards): in
shards that keep every prompt group whole when the estimator reads groups, equal ones where the groups allow, else
shards of unequal row counts (tests/unit/test_group_shards.py). (The numbers of the stage:
tests/distributed/test_stage_estimators.py, tests/distributed/test_uneven_group_shards.py.)"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlsp.config.schema import RLSPConfig
from rlsp.data.balance import balanced_order
from rlsp.data.batch import Batch
from rlsp.step.stage_advantages import balanced_group_order, balanced_step_order, stage_shards, whole_groups
from rlsp.workers.step_stage import StageRequest


def _cfg(name: str, **correction):
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator = name
    for key, value in correction.items():
        cfg.algorithm.rollout_correction[key] = value
    return cfg


def _rows(uids: list[str]) -> Batch:
    return Batch.from_dict({"response_mask": torch.ones(len(uids), 3)}, meta={"uid": uids})


INTERLEAVED = [f"p{i % 4}" for i in range(8)]  # 4 groups of 2, a group's rows apart


def _whole_groups(order: list[int], uids: list[str], parts: int) -> bool:
    size = len(order) // parts
    chunks = [{uids[r] for r in order[p * size:(p + 1) * size]} for p in range(parts)]
    return sorted(order) == list(range(len(uids))) and all(not a & b for i, a in enumerate(chunks) for b in chunks[i + 1:])


@pytest.mark.parametrize("name", ["grpo", "rloo", "gpg", "opo", "grpo_passk", "reinforce_plus_plus_baseline",
                                  "optimal_token_baseline", "tir_optimal_token_baseline"])
def test_group_estimators_get_group_aligned_shards(name):
    order, shards = stage_shards(_rows(INTERLEAVED), _cfg(name), dp=2)
    assert shards is None and order != list(range(8)) and _whole_groups(order, INTERLEAVED, 2)
    assert stage_shards(_rows(INTERLEAVED), _cfg(name), dp=1) == (list(range(8)), None)
    order, shards = stage_shards(_rows(INTERLEAVED), _cfg(name), dp=8)  # one row a shard: a group of 2 cannot fit
    assert shards == [2, 2, 2, 2, 0, 0, 0, 0] and [INTERLEAVED[r] for r in order] == sorted(INTERLEAVED)


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "remax"])
def test_estimators_without_groups_keep_the_step_order(name):
    assert stage_shards(_rows(INTERLEAVED), _cfg(name), dp=8) == (list(range(8)), None)


def test_gdpo_and_the_weighted_token_baselines_get_group_shards():
    # gdpo runs on the workers, its reward components sent per row (the stage needs their names)
    assert _whole_groups(stage_shards(_rows(INTERLEAVED), _cfg("gdpo"), dp=2)[0], INTERLEAVED, 2)
    with pytest.raises(ValueError, match=r"'gdpo' reads named reward components.*algorithm.gdpo_reward_keys"):
        StageRequest("gdpo")
    with_weights = _cfg("optimal_token_baseline", rollout_is="token")  # its weights: the correction's worker column
    assert _whole_groups(stage_shards(_rows(INTERLEAVED), with_weights, dp=2)[0], INTERLEAVED, 2)
    assert stage_shards(_rows(INTERLEAVED), _cfg("optimal_token_baseline", rollout_rs="token_k1"), dp=2)[1] is None


def test_balancing_keeps_groups_whole_when_the_workers_need_them():
    tokens = [9, 1, 8, 2, 7, 3, 6, 4]  # rows 0..7 of groups p0..p3 (interleaved)
    order = balanced_step_order(_cfg("grpo"), tokens, INTERLEAVED, 2)  # plain grpo: per-row values, rows balanced
    assert order == balanced_order(tokens, 2)
    kl = _cfg("grpo")
    kl.algorithm.use_kl_in_reward = True
    order = balanced_step_order(kl, tokens, INTERLEAVED, 2)
    assert _whole_groups(order, INTERLEAVED, 2) and whole_groups([INTERLEAVED[r] for r in order], 2)
    loads = [sum(tokens[r] for r in order[:4]), sum(tokens[r] for r in order[4:])]
    assert loads == [20, 20]  # groups weigh 16, 10, 8, 6: heaviest first into the lighter half
    assert stage_shards(_rows([INTERLEAVED[r] for r in order]), kl, dp=2) == (list(range(8)), None)  # no reordering
    assert not whole_groups(INTERLEAVED, 2) and whole_groups(INTERLEAVED, 1)
    # Two heavy single rows first, one into each half, leave no room for the third pair: first fit by size then.
    uneven, heavy = ["s1", "a", "a", "b", "b", "c", "c", "s2"], [50, 1, 1, 1, 1, 1, 1, 40]
    assert balanced_group_order(heavy, uneven, 2) is None
    assert balanced_step_order(kl, heavy, uneven, 2) == [1, 2, 3, 4, 0, 5, 6, 7]
