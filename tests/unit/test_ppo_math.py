"""PPO math against hand-computed numbers: GAE on rows of different lengths, the KL penalty in the
reward, the fixed and adaptive KL controllers, the clipped value loss and explained variance."""

from __future__ import annotations

import statistics

import pytest
import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.gae import compute_gae_advantages
from rlsp.algos.kl_ctrl import AdaptiveKLController, FixedKLController, apply_kl_penalty, build_kl_controller
from rlsp.algos.registry import compute_advantages, estimator_uses, list_adv_estimators
from rlsp.algos.value_loss import compute_value_loss, explained_variance
from rlsp.config.layout import CRITIC_ESTIMATORS


def test_gae_hand_computed_on_rows_of_different_lengths():
    # Row 0: three tokens, reward 1 at the end. Row 1: two tokens (third is padding with junk).
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7], [0.1, 0.2, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    adv, ret = compute_gae_advantages(AdvantageInputs(rewards, mask, None, gamma=0.9, lam=0.8, values_BR=values, eps=0.0))
    # delta_t = r_t + 0.9 V_{t+1} - V_t ; A_t = delta_t + 0.72 A_{t+1}, worked out by hand:
    raw = [0.21712, 0.246, 0.3, 1.376, 1.8]  # row 0: t=0..2, row 1: t=0..1
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0], [1.476, 2.0, 0.0]], dtype=torch.float64))
    mean, std = statistics.fmean(raw), statistics.stdev(raw)
    whitened = [(a - mean) / std for a in raw]
    expected = torch.tensor([whitened[:3], whitened[3:] + [0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


def test_registry_guards_what_each_estimator_uses():
    assert estimator_uses("gae") == ("gamma", "lam", "values_BR", "reduce")  # reduce: it runs on a shard too
    assert "values_BR" not in estimator_uses("grpo")
    # The estimators that need values are exactly those that get a critic.
    assert sorted(e for e in list_adv_estimators() if "values_BR" in estimator_uses(e)) == list(CRITIC_ESTIMATORS)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones_like(rewards)
    settings = dict(norm_adv_by_std=True, gamma=0.5, lam=0.5, values_BR=torch.zeros_like(rewards))
    with pytest.raises(ValueError, match="'grpo' does not use gamma; got 0.5, leave it at its default 1.0"):
        compute_advantages("grpo", AdvantageInputs(rewards, mask, ["a", "a"], **settings))  # never silently dropped
    defaults = dict(norm_adv_by_std=True, gamma=1.0, lam=1.0, values_BR=None)
    grpo, _ = compute_advantages("grpo", AdvantageInputs(rewards, mask, ["a", "a"], **defaults))
    assert grpo[0, 0] > 0 > grpo[1, 0]
    _, ret = compute_advantages("gae", AdvantageInputs(rewards, mask, ["a", "a"], **settings))
    torch.testing.assert_close(ret, torch.tensor([[0.25, 1.0], [0.0, 0.0]]))  # (gamma * lam) * 1: both passed


def test_kl_penalty_in_reward():
    scores = torch.tensor([[0.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rewards, kl = apply_kl_penalty(scores, old, ref, mask, beta=0.1, kind="kl")
    # kl per token = old - ref = [0.5, -1.0]; rewards = scores - 0.1 * kl; padding gets 0
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 1.1, 0.0]]))
    assert kl == pytest.approx(-0.25)
    _, kl_abs = apply_kl_penalty(scores, old, ref, mask, beta=0.1, kind="abs")
    assert kl_abs == pytest.approx(0.75)


def test_fixed_and_adaptive_kl_controllers_follow_their_formulas():
    fixed = build_kl_controller("fixed", 0.05)
    fixed.update(current_kl=3.0, n_steps=1000)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    ctl = build_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(current_kl=0.055, n_steps=10)  # error = 0.055/0.05 - 1 = 0.1 -> x (1 + 0.1 * 10/100)
    assert ctl.value == pytest.approx(0.1 * 1.01)
    ctl.update(current_kl=1.0, n_steps=10)  # error clipped to +0.2 -> x 1.02
    assert ctl.value == pytest.approx(0.1 * 1.01 * 1.02)
    ctl.update(current_kl=0.0, n_steps=50)  # error clipped to -0.2 -> x 0.9
    assert ctl.value == pytest.approx(0.1 * 1.01 * 1.02 * 0.9)
    restored = build_kl_controller("adaptive", 0.5, target_kl=0.05, horizon=100)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="legal: 'fixed', 'adaptive'"):
        build_kl_controller("pid", 0.1)


def test_clipped_value_loss_and_explained_variance():
    values = torch.tensor([1.0, 0.0, 2.0, 7.0])
    old = torch.tensor([0.0, 0.0, 2.5, 0.0])
    returns = torch.tensor([1.0, 1.0, 0.0, 0.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss, sums = compute_value_loss(values, old, returns, mask, cliprange_value=0.5)
    # token 0: v clipped to 0.5 -> max((1-1)^2, (0.5-1)^2) = 0.25 (clipped term wins)
    # token 1: no change -> 1.0 ; token 2: clip to 2.0 (within 0.5 of 2.5) -> 4.0 ; token 3 masked
    torch.testing.assert_close(loss, torch.tensor([0.125, 0.5, 2.0, 0.0]))
    assert float(sums["vf_clipfrac_sum"]) == 1.0 and float(sums["vpred_sum"]) == 3.0
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(g, g, torch.ones(4)) == 1.0
    assert explained_variance(torch.full((4,), 2.5), g, torch.ones(4)) == pytest.approx(0.0)
