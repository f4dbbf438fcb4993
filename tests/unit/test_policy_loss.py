"""PPO clip loss (registered as "vanilla"): values, dual clip, gradients, metrics and errors."""

from __future__ import annotations

import math

import pytest
import torch

from rlsp.algos.policy_loss import compute_ppo_clip_loss
from rlsp.algos.registry import get_policy_loss, list_policy_losses

F64 = torch.float64


def test_registered_as_vanilla() -> None:
    assert "vanilla" in list_policy_losses()
    assert get_policy_loss("vanilla") is compute_ppo_clip_loss


def test_inside_clip_range_equals_unclipped_surrogate() -> None:
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=gen, dtype=F64)
    log_ratio = (torch.rand(3, 5, generator=gen, dtype=F64) - 0.5) * 0.3  # ratio in (0.86, 1.16)
    adv = torch.randn(3, 5, generator=gen, dtype=F64)
    mask = torch.ones(3, 5, dtype=F64)
    loss, metrics = compute_ppo_clip_loss(old + log_ratio, old, adv, mask)
    torch.testing.assert_close(loss, -adv * torch.exp(log_ratio), rtol=0, atol=1e-12)
    assert metrics["pg_clipfrac"].item() == 0.0 and metrics["pg_clipfrac_lower"].item() == 0.0
    torch.testing.assert_close(metrics["ppo_kl"], (-log_ratio).mean(), rtol=0, atol=1e-12)


# Tokens: (ratio, advantage, expected loss, clipped by range, clipped by dual clip, has gradient).
CASES = [
    (1.1, 1.0, -1.1, False, False, True),  # inside range
    (1.5, 1.0, -1.2, True, False, False),  # A > 0, ratio above 1 + high: capped at 1.2
    (0.5, 1.0, -0.5, False, False, True),  # A > 0, ratio below 1 - low: pessimistic unclipped branch
    (0.5, -1.0, 0.8, True, False, False),  # A < 0, ratio below 1 - low: capped at 0.8
    (1.5, -1.0, 1.5, False, False, True),  # A < 0, ratio above range but below c: unclipped
    (10.0, -2.0, 6.0, False, True, False),  # A < 0, huge ratio: dual clip -A * c = 2 * 3
]


def _case_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ratio = torch.tensor([c[0] for c in CASES], dtype=F64)
    old = torch.linspace(-2.0, -0.5, len(CASES), dtype=F64)
    logprobs = (old + torch.log(ratio)).requires_grad_(True)
    adv = torch.tensor([c[1] for c in CASES], dtype=F64)
    return logprobs, old, adv


def test_clipped_and_dual_clipped_values_and_metrics() -> None:
    logprobs, old, adv = _case_tensors()
    mask = torch.ones(len(CASES), dtype=F64)
    loss, metrics = compute_ppo_clip_loss(logprobs, old, adv, mask, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([c[2] for c in CASES], dtype=F64), rtol=0, atol=1e-12)
    n = len(CASES)
    assert metrics["num_tokens"].item() == n
    assert metrics["pg_clipfrac_sum"].item() == sum(c[3] for c in CASES)
    assert metrics["pg_clipfrac_lower_sum"].item() == sum(c[4] for c in CASES)
    assert metrics["pg_clipfrac"].item() == pytest.approx(sum(c[3] for c in CASES) / n, abs=1e-12)
    expected_kl = -sum(math.log(c[0]) for c in CASES)
    assert metrics["ppo_kl_sum"].item() == pytest.approx(expected_kl, abs=1e-12)
    assert all(not v.requires_grad for v in metrics.values())


def test_gradients_zero_exactly_where_clipped() -> None:
    logprobs, old, adv = _case_tensors()
    loss, _ = compute_ppo_clip_loss(logprobs, old, adv, torch.ones(len(CASES), dtype=F64))
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    ratio = torch.tensor([c[0] for c in CASES], dtype=F64)
    has_grad = torch.tensor([c[5] for c in CASES])
    # d(-A * exp(lp - old)) / d lp = -A * ratio where unclipped; 0 where a clip bound is active.
    expected = torch.where(has_grad, -adv * ratio, torch.zeros_like(ratio))
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)


def test_asymmetric_clip_range() -> None:
    old = torch.zeros(2, dtype=F64)
    logprobs = torch.log(torch.tensor([1.25, 0.85], dtype=F64))
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, _ = compute_ppo_clip_loss(logprobs, old, adv, torch.ones(2), clip_ratio_low=0.1, clip_ratio_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([-1.25, 0.9], dtype=F64), rtol=0, atol=1e-12)


def test_mask_zeroes_loss_and_ignores_garbage() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("inf"), 0.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, metrics = compute_ppo_clip_loss(logprobs, old, adv, mask)
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64), rtol=0, atol=0)
    assert metrics["num_tokens"].item() == 3
    assert all(torch.isfinite(v).all() for v in metrics.values())


def test_extreme_log_ratio_stays_finite() -> None:
    logprobs = torch.tensor([1000.0, 1000.0, -1000.0], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, -1.0])
    loss, _ = compute_ppo_clip_loss(logprobs, old, adv, torch.ones(3))
    torch.testing.assert_close(loss, torch.tensor([-1.2, 3.0, 0.8]), rtol=0, atol=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"clip_ratio_c": 0.5}, "clip_ratio_c"),
        ({"clip_ratio_low": 1.0}, "clip_ratio_low"),
        ({"clip_ratio_high": -0.1}, "clip_ratio_high"),
    ],
)
def test_invalid_clip_arguments_raise(kwargs: dict[str, float], match: str) -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=match):
        compute_ppo_clip_loss(x, x, x, torch.ones(2), **kwargs)
