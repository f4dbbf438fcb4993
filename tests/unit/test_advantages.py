"""Advantage estimators (GRPO, RLOO, REINFORCE++, GAE) against hand-computed values and fp64 loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import rlsp.algos  # noqa: F401  (fills the registries)
from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.gae import compute_gae_advantages
from rlsp.algos.grpo import compute_grpo_advantages
from rlsp.algos.registry import get_adv_estimator, list_adv_estimators
from rlsp.algos.reinforce_pp import (
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_returns_to_go,
)
from rlsp.algos.rloo import compute_rloo_advantages

F64 = torch.float64
SQRT3 = math.sqrt(3.0)


def _outcome_batch(scores: list[float], lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards on each row's last response token, garbage (99) on padding; right-padded mask."""
    rewards = torch.full((len(scores), width), 99.0, dtype=F64)
    mask = torch.zeros(len(scores), width, dtype=F64)
    for row, (score, length) in enumerate(zip(scores, lengths)):
        rewards[row, :length] = 0.0
        rewards[row, length - 1] = score
        mask[row, :length] = 1.0
    return rewards, mask


# Two groups of 3, interleaved rows: group "a" scores [1, 0, 1], group "b" scores [0, 0, 1].
SCORES = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
INDEX = ["a", "b", "a", "b", "a", "b"]
LENGTHS = [4, 1, 2, 3, 4, 2]


def test_grpo_hand_example_with_std() -> None:
    rewards, mask = _outcome_batch(SCORES, LENGTHS, 4)
    adv, ret = compute_grpo_advantages(AdvantageInputs(rewards, mask, INDEX, eps=0.0))
    # Group a: mean 2/3, unbiased std 1/sqrt(3): (1/3)*sqrt(3), (-2/3)*sqrt(3). Group b: mean 1/3.
    expected_row = torch.tensor([1 / SQRT3, -1 / SQRT3, -2 / SQRT3, -1 / SQRT3, 1 / SQRT3, 2 / SQRT3], dtype=F64)
    torch.testing.assert_close(adv, expected_row[:, None] * mask, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, adv, rtol=0, atol=0)
    assert torch.all(adv[mask == 0] == 0)


def test_grpo_hand_example_without_std_and_default_eps() -> None:
    rewards, mask = _outcome_batch(SCORES, LENGTHS, 4)
    adv, _ = compute_grpo_advantages(AdvantageInputs(rewards, mask, INDEX, norm_adv_by_std=False))
    expected_row = torch.tensor([1 / 3, -1 / 3, -2 / 3, -1 / 3, 1 / 3, 2 / 3], dtype=F64)
    torch.testing.assert_close(adv, expected_row[:, None] * mask, rtol=0, atol=1e-12)
    adv_eps, _ = compute_grpo_advantages(AdvantageInputs(rewards, mask, INDEX))  # eps=1e-6 shifts values by < 1e-5
    expected_std = torch.tensor([1, -1, -2, -1, 1, 2], dtype=F64) / (1 / SQRT3 + 1e-6) / 3
    torch.testing.assert_close(adv_eps, expected_std[:, None] * mask, rtol=0, atol=1e-12)


def test_grpo_single_member_group_and_float32_bool_mask() -> None:
    rewards, mask = _outcome_batch([2.0, 1.0, 0.0], [1, 2, 2], 2)
    adv, _ = compute_grpo_advantages(AdvantageInputs(rewards.float(), mask.bool(), ["x", "y", "y"], eps=0.0))
    # "x" alone: mean 0, std 1 -> raw score. "y": mean 0.5, std sqrt(0.5).
    expected = torch.tensor([[2.0, 0.0], [0.5 / math.sqrt(0.5)] * 2, [-0.5 / math.sqrt(0.5)] * 2])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    assert adv.dtype == torch.float32


def test_grpo_matches_torch_std_on_random_groups() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, 5, generator=gen, dtype=F64)
    mask = torch.ones(12, 5, dtype=F64)
    index = [f"p{i // 4}" for i in range(12)]
    adv, _ = compute_grpo_advantages(AdvantageInputs(rewards, mask, index, eps=1e-6))
    scores = rewards.sum(-1).view(3, 4)
    expected = (scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(adv[:, 0], expected.reshape(-1), rtol=0, atol=1e-12)


def test_rloo_hand_example_and_singleton() -> None:
    rewards, mask = _outcome_batch(SCORES, LENGTHS, 4)
    adv, ret = compute_rloo_advantages(AdvantageInputs(rewards, mask, INDEX))
    # a: [1-0.5, 0-1, 1-0.5]; b: [0-0.5, 0-0.5, 1-0].
    expected_row = torch.tensor([0.5, -0.5, -1.0, -0.5, 0.5, 1.0], dtype=F64)
    torch.testing.assert_close(adv, expected_row[:, None] * mask, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, adv, rtol=0, atol=0)
    rewards1, mask1 = _outcome_batch([3.0, 1.0, 2.0], [1, 1, 1], 1)
    adv1, _ = compute_rloo_advantages(AdvantageInputs(rewards1, mask1, ["solo", "g", "g"]))
    torch.testing.assert_close(adv1[:, 0], torch.tensor([3.0, -1.0, 1.0], dtype=F64), rtol=0, atol=1e-12)


def test_returns_to_go_discounts_and_skips_mask_holes() -> None:
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 100.0], [1.0, 50.0, 2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]], dtype=F64)
    returns = compute_returns_to_go(rewards, mask, gamma=0.5)
    expected = torch.tensor([[1.5, 1.0, 2.0], [1.5, 3.0, 0.0], [2.0, 0.0, 2.0]], dtype=F64)
    torch.testing.assert_close(returns, expected, rtol=0, atol=1e-12)


def test_reinforce_pp_hand_example() -> None:
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 100.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv, ret = compute_reinforce_pp_advantages(AdvantageInputs(rewards, mask, ["a", "b"], gamma=0.5, eps=0.0))
    # Returns [1.5, 1, 2 | 1.5, 3]: mean 1.8, squared deviations sum 2.3, unbiased var 0.575.
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 2.0], [1.5, 3.0, 0.0]], dtype=F64), rtol=0, atol=1e-12)
    expected = torch.tensor([[-0.3, -0.8, 0.2], [-0.3, 1.2, 0.0]], dtype=F64) / math.sqrt(0.575)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_reinforce_pp_baseline_hand_example() -> None:
    rewards, mask = _outcome_batch([1.0, 0.0, 5.0], [2, 1, 2], 2)
    adv, ret = compute_reinforce_pp_baseline_advantages(AdvantageInputs(rewards, mask, ["a", "a", "b"], eps=0.0))
    # Group a mean 0.5; "b" alone keeps its score. Tokens [.5, .5, -.5, 5, 5]: mean 2.1, var 28.7/4.
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.5], [-0.5, 0.0], [5.0, 5.0]], dtype=F64), rtol=0, atol=1e-12)
    expected = torch.tensor([[-1.6, -1.6], [-2.6, 0.0], [2.9, 2.9]], dtype=F64) / math.sqrt(7.175)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def _gae_reference(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Plain Python loop over each row's masked-in tokens, then whitening with statistics.variance."""
    raw = [[0.0] * rewards.shape[1] for _ in range(rewards.shape[0])]
    for b in range(rewards.shape[0]):
        valid = [t for t in range(rewards.shape[1]) if mask[b, t] > 0]
        next_v, next_a = 0.0, 0.0
        for t in reversed(valid):
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            next_a = delta + gamma * lam * next_a
            next_v = values[b, t].item()
            raw[b][t] = next_a
    flat = [raw[b][t] for b in range(len(raw)) for t in range(len(raw[0])) if mask[b, t] > 0]
    mean, std = statistics.fmean(flat), math.sqrt(statistics.variance(flat))
    adv = torch.tensor([[(a - mean) / std for a in row] for row in raw], dtype=F64) * mask
    ret = (torch.tensor(raw, dtype=F64) + values) * mask
    return adv, ret


@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_reference_loop(holes: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 7, generator=gen, dtype=F64)
    values = torch.randn(4, 7, generator=gen, dtype=F64)
    mask = (torch.arange(7)[None, :] < torch.tensor([7, 3, 1, 5])[:, None]).to(F64)
    if holes:
        mask[0, 2] = mask[0, 4] = mask[3, 1] = 0.0
    adv, ret = compute_gae_advantages(AdvantageInputs(rewards, mask, None, gamma=0.9, lam=0.8, values_BR=values, eps=0.0))
    exp_adv, exp_ret = _gae_reference(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, exp_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, exp_ret, rtol=0, atol=1e-12)


def test_gae_requires_values() -> None:
    rewards, mask = _outcome_batch([1.0], [1], 1)
    with pytest.raises(ValueError, match="values_BR"):
        compute_gae_advantages(AdvantageInputs(rewards, mask, ["a"]))


def test_registry_names_and_errors() -> None:
    assert list_adv_estimators() == ["gae", "gdpo", "gpg", "grpo", "grpo_passk", "grpo_vectorized", "opo",
                                     "optimal_token_baseline", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                     "remax", "rloo", "rloo_vectorized", "tir_optimal_token_baseline"]
    assert get_adv_estimator("grpo") is compute_grpo_advantages
    with pytest.raises(ValueError, match="legal names: gae, gdpo, gpg, grpo, grpo_passk"):
        get_adv_estimator("ppo")


def test_unused_non_default_kwargs_raise() -> None:
    rewards, mask = _outcome_batch([1.0, 0.0], [1, 1], 1)
    with pytest.raises(ValueError, match="gamma"):
        get_adv_estimator("grpo")(AdvantageInputs(rewards, mask, ["a", "a"], gamma=0.9))
    with pytest.raises(ValueError, match="norm_adv_by_std"):
        get_adv_estimator("rloo")(AdvantageInputs(rewards, mask, ["a", "a"], norm_adv_by_std=False))
    with pytest.raises(ValueError, match="values_BR"):
        get_adv_estimator("reinforce_plus_plus")(AdvantageInputs(rewards, mask, ["a", "a"], values_BR=rewards))
    required = {"gae": {"values_BR": torch.zeros_like(rewards)}, "remax": {"reward_baselines_B": torch.zeros(2)},
                "gdpo": {"reward_components": {"score": torch.tensor([1.0, 0.0])}},
                "optimal_token_baseline": {"old_logprobs_BR": -rewards, "sum_pi_squared_BR": mask},
                "tir_optimal_token_baseline": {"old_logprobs_BR": -rewards, "sum_pi_squared_BR": mask}}
    for name in list_adv_estimators():  # defaults (plus the inputs an estimator needs) are accepted by every estimator
        extra = required.get(name, {})
        adv, ret = get_adv_estimator(name)(AdvantageInputs(rewards, mask, ["a", "a"], norm_adv_by_std=True, gamma=1.0, lam=1.0, **extra))
        assert adv.shape == ret.shape == rewards.shape
