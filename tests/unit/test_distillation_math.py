"""On-policy distillation math (rlsp/algos/distillation.py) against values worked out by hand from the formula:
d = clamp(D(max(s, m), max(q, m)), -c, c), A = A_task - coef * d (or -d). Every element, tolerance 1e-6."""

from __future__ import annotations

import math

import pytest
import torch

from rlsp.algos.distillation import (
    compute_distillation_advantages,
    compute_distillation_losses,
    distillation_metrics,
)

TOL = 1e-6
S = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -20.0, 0.0]], dtype=torch.float64)  # student logprobs
Q = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -0.1, -7.0]], dtype=torch.float64)  # teacher logprobs
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def _close(got: torch.Tensor, want: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=TOL, rtol=0)


def test_k1_is_the_sampled_reverse_kl_student_minus_teacher():
    d = compute_distillation_losses(S, Q, MASK, loss_mode="k1")
    _close(d, [[0.5, -1.0, 0.0], [-1.0, -19.9, 0.0]])  # the masked position is 0, not 7.0


def test_floor_then_clamp():
    # s[1,1] = -20 is floored at -10: -10 - (-0.1) = -9.9, then clamped to -5
    d = compute_distillation_losses(S, Q, MASK, loss_mode="k1", loss_max_clamp=5.0, log_prob_min_clamp=-10.0)
    _close(d, [[0.5, -1.0, 0.0], [-1.0, -5.0, 0.0]])


def test_k3_low_variance_estimator():
    def k3(s: float, q: float) -> float:
        return math.exp(q - s) - (q - s) - 1.0

    d = compute_distillation_losses(S, Q, MASK, loss_mode="k3", loss_max_clamp=5.0, log_prob_min_clamp=-10.0)
    # [1,1]: exp(9.9) - 9.9 - 1 is ~2e4, clamped to 10 by the k3 estimator and to 5 by loss_max_clamp
    _close(d, [[k3(-1.0, -1.5), k3(-2.0, -1.0), 0.0], [k3(-3.0, -2.0), 5.0, 0.0]])
    assert abs(k3(-1.0, -1.5) - 0.10653065971263342) < TOL and abs(k3(-2.0, -1.0) - (math.e - 2.0)) < TOL


@pytest.mark.parametrize("mode,want", [("abs", [[0.5, 1.0, 0.0], [1.0, 19.9, 0.0]]),
                                       ("k2", [[0.125, 0.5, 0.0], [0.5, 0.5 * 19.9**2, 0.0]])])
def test_other_estimators(mode, want):
    _close(compute_distillation_losses(S, Q, MASK, loss_mode=mode), want)


def test_losses_are_detached():
    s = S.clone().requires_grad_(True)
    d = compute_distillation_losses(s, Q, MASK, loss_mode="k1")
    assert not d.requires_grad


def test_advantages_with_and_without_task_rewards():
    d = compute_distillation_losses(S, Q, MASK, loss_mode="k1", loss_max_clamp=5.0, log_prob_min_clamp=-10.0)
    task = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    with_task = compute_distillation_advantages(task, d, MASK, use_task_rewards=True, coef=0.5)
    # 1 - 0.5 * [0.5, -1, 0];  -0.5 - 0.5 * [-1, -5, (masked)]
    _close(with_task, [[0.75, 1.5, 1.0], [0.0, 2.0, 0.0]])
    alone = compute_distillation_advantages(task, d, MASK, use_task_rewards=False, coef=0.5)  # coef unused, as in verl
    _close(alone, [[-0.5, 1.0, 0.0], [1.0, 5.0, 0.0]])
    with pytest.raises(ValueError, match="use_task_rewards=true needs the task advantages"):
        compute_distillation_advantages(None, d, MASK)


def test_metrics():
    d = compute_distillation_losses(S, Q, MASK, loss_mode="k1", loss_max_clamp=5.0, log_prob_min_clamp=-10.0)
    m = distillation_metrics(S, Q, d, MASK)
    want = {"distillation/reverse_kl": (0.5 - 1.0 + 0.0 - 1.0 - 19.9) / 5,  # unclamped student - teacher
            "distillation/loss": (0.5 - 1.0 + 0.0 - 1.0 - 5.0) / 5,
            "distillation/abs_loss": (0.5 + 1.0 + 0.0 + 1.0 + 5.0) / 5,
            "distillation/loss_min": -5.0, "distillation/loss_max": 0.5,
            "distillation/teacher_logprob_mean": (-1.5 - 1.0 - 0.5 - 2.0 - 0.1) / 5}
    assert m.keys() == want.keys()
    for key, val in want.items():
        assert abs(m[key] - val) < TOL, key
    assert distillation_metrics(S, Q, d, torch.zeros_like(MASK)) == {}


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match=r"shapes differ: student \(2, 3\), teacher \(2, 2\)"):
        compute_distillation_losses(S, Q[:, :2], MASK)
