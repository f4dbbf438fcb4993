"""ReMax (arXiv:2310.10505): advantage = reward-to-go minus the reward of the prompt's greedy response.

The estimator is compared element by element with values worked out by hand (fp64, atol 1e-12, rtol 0),
on rows with rewards spread over several tokens, a hole in the mask, an empty row and garbage (99) on
masked-out positions. The trainer side is checked on real Batches: the prompts a greedy pass takes from the
step's prompt rows by the samples' uids (ids, meta, order, padding to the rollout world), the greedy sampling settings, and the
start-up refusals.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import rlsp.algos  # noqa: F401  (fills the registries)
from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.registry import estimator_uses, get_adv_estimator
from rlsp.algos.remax import compute_remax_advantages
from rlsp.config.schema import RLSPConfig
from rlsp.data.batch import Batch
from rlsp.step.baselines import greedy_sampling, prompts_of
from rlsp.step.estimator_inputs import estimator_errors
from rlsp.trainer.rollout_inputs import prompt_batch

F64 = torch.float64
G = 99.0  # garbage on masked-out positions: must never leak into the results
TOL = {"rtol": 0.0, "atol": 1e-12}


def test_remax_by_hand() -> None:
    rewards = torch.tensor([[0.5, 0.0, 1.0, G], [2.0, G, 1.0, 0.0], [G, G, G, G]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]], dtype=F64)
    baselines = torch.tensor([0.25, -1.0, 3.0], dtype=F64)
    adv, ret = compute_remax_advantages(AdvantageInputs(rewards, mask, ["a", "b", "c"], reward_baselines_B=baselines))
    # Row 0: G = [1.5, 1, 1, -]; A = G - 0.25. Row 1 (hole at 1): G = [3, -, 1, 0]; A = G + 1. Row 2: empty.
    expected_ret = torch.tensor([[1.5, 1.0, 1.0, 0.0], [3.0, 0.0, 1.0, 0.0], [0.0] * 4], dtype=F64)
    expected_adv = torch.tensor([[1.25, 0.75, 0.75, 0.0], [4.0, 0.0, 2.0, 1.0], [0.0] * 4], dtype=F64)
    torch.testing.assert_close(ret, expected_ret, **TOL)
    torch.testing.assert_close(adv, expected_adv, **TOL)


def test_remax_outcome_reward_gives_score_minus_greedy_score_on_every_token() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, G]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=F64)
    baselines = torch.tensor([1.0, 1.0, 0.0], dtype=F64)  # rows 0, 1 share a prompt whose greedy answer scored 1
    adv, _ = get_adv_estimator("remax")(AdvantageInputs(rewards, mask, ["p", "p", "q"], reward_baselines_B=baselines))
    torch.testing.assert_close(adv, torch.tensor([[0.0] * 3, [-1.0] * 3, [1.0, 1.0, 0.0]], dtype=F64), **TOL)


def test_remax_needs_one_baseline_per_row_and_refuses_other_settings() -> None:
    rewards, mask = torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="'remax' needs reward_baselines_B"):
        compute_remax_advantages(AdvantageInputs(rewards, mask, ["a", "b"]))
    with pytest.raises(ValueError, match=r"need one baseline per row, \[2\]"):
        compute_remax_advantages(AdvantageInputs(rewards, mask, ["a", "b"], reward_baselines_B=torch.zeros(3)))
    with pytest.raises(ValueError, match="'remax' does not use gamma"):
        compute_remax_advantages(AdvantageInputs(rewards, mask, ["a", "b"], gamma=0.9, reward_baselines_B=torch.zeros(2)))
    with pytest.raises(ValueError, match="'grpo' does not use reward_baselines_B"):
        get_adv_estimator("grpo")(AdvantageInputs(rewards, mask, ["a", "a"], reward_baselines_B=torch.zeros(2)))
    assert estimator_uses("remax") == ("reward_baselines_B",)


def _step_prompts() -> Batch:
    """The prompt rows a step sent (rlsp.trainer.rollout_inputs.prompt_batch): three prompts, and one sent in another
    round whose samples were all dropped."""
    items = [{"prompt_ids": ids, "data_source": f"d{k}", "ground_truth": str(k), "index": k}
             for k, ids in enumerate([[5, 6, 7], [8], [9, 10], [11]], start=1)]
    return prompt_batch(items, ["u1", "u2", "u3", "u4"])


def test_prompts_of_the_samples_one_per_uid_padded_to_the_world() -> None:
    uids = ["u3", "u1", "u2", "u3", "u1", "u2"]  # the samples' uids in balanced order: first seen u3, u1, u2
    prompts, real = prompts_of(uids, _step_prompts(), world_size=2)
    assert real == 3 and len(prompts) == 4  # padded with the first prompt again
    assert prompts.meta["uid"] == ["u3", "u1", "u2", "u3"]
    assert prompts.meta["prompt_ids"] == [[9, 10], [5, 6, 7], [8], [9, 10]]
    assert prompts.meta["ground_truth"] == ["3", "1", "2", "3"] and prompts.meta["index"] == [3, 1, 2, 3]
    assert set(prompts.meta) == set(_step_prompts().meta)  # the prompt's own fields, as the step sent them
    assert torch.equal(prompts["prompt_index"], torch.arange(4))
    assert prompts_of(uids, _step_prompts(), world_size=3)[0].meta["uid"] == ["u3", "u1", "u2"]


def test_greedy_sampling_keeps_the_limits_and_takes_one_argmax_sample() -> None:
    step = {"n": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_tokens": 33, "seed": 5, "ignore_eos": True}
    assert greedy_sampling(step) == {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 33,
                                     "seed": 5, "ignore_eos": True}


def test_start_up_refuses_remax_with_generation_ahead_on_a_rollout_pool() -> None:
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator = "remax"
    assert estimator_errors(cfg) == []
    cfg.rollout.n_gpus_per_node = 1
    (error,) = estimator_errors(cfg)
    assert "algorithm.adv_estimator='remax' needs a greedy response per prompt" in error and "rollout pool" in error
    cfg.algorithm.gamma = 0.9
    assert any("algorithm.gamma=0.9 has no effect with algorithm.adv_estimator='remax'" in e for e in estimator_errors(cfg))
