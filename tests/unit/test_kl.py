"""KL estimators against closed forms in fp64, aliases, k3 sign and clamping."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import roundoff_rtol, scalar_tol

from rlsp.algos.kl import compute_kl

F64 = torch.float64


def _random_logprobs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(4, 9, generator=gen, dtype=F64) * 3.0
    ref = -torch.rand(4, 9, generator=gen, dtype=F64) * 3.0
    return logprobs, ref


def test_closed_forms() -> None:
    lp, ref = _random_logprobs(0)
    d = (lp - ref).tolist()
    closed = {
        "k1": d,
        "abs": [[abs(x) for x in row] for row in d],
        "k2": [[0.5 * x * x for x in row] for row in d],
        # k3 with u = ref - lp = -x: e^u - u - 1.
        "k3": [[math.exp(-x) + x - 1.0 for x in row] for row in d],
    }
    for kind, expected in closed.items():
        torch.testing.assert_close(compute_kl(lp, ref, kind), torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("alias, canonical", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_aliases_equal(alias: str, canonical: str) -> None:
    lp, ref = _random_logprobs(1)
    torch.testing.assert_close(compute_kl(lp, ref, alias), compute_kl(lp, ref, canonical), rtol=0, atol=0)


def test_k3_nonnegative_zero_at_equality_and_clamped() -> None:
    lp, ref = _random_logprobs(2)
    assert (compute_kl(lp, ref, "k3") >= 0).all()
    assert (compute_kl(lp, lp, "k3") == 0).all()
    # ref - lp = 5: e^5 - 6 > 10 -> clamped; ref - lp = -50: 49 > 10 -> clamped.
    extreme = compute_kl(torch.tensor([0.0, 0.0], dtype=F64), torch.tensor([5.0, -50.0], dtype=F64), "k3")
    torch.testing.assert_close(extreme, torch.tensor([10.0, 10.0], dtype=F64), rtol=0, atol=0)


def test_k3_gradient_finite_for_huge_log_ratio() -> None:
    lp = torch.tensor([-1000.0, 0.0, -0.3], requires_grad=True)
    ref = torch.tensor([0.0, -1000.0, -0.1])
    (grad,) = torch.autograd.grad(compute_kl(lp, ref, "k3").sum(), lp)
    assert torch.isfinite(grad).all()
    # Unclamped token: d/dlp (e^(ref-lp) - (ref-lp) - 1) = 1 - e^(ref-lp).
    # fp32 both ways, a few operations on O(1) values (the exp, the subtraction): tests/tolerances.py
    assert grad[2].item() == pytest.approx(1.0 - torch.exp(torch.tensor(0.2)).item(),
                                           abs=scalar_tol(1.0, roundoff_rtol(reduction=1, stages=3)))
    assert grad[0].item() == 0.0 and grad[1].item() == 0.0


def test_unknown_kind_and_shape_mismatch_raise() -> None:
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="legal kinds: k1, kl, abs"):
        compute_kl(x, x, "k4")
    with pytest.raises(ValueError, match="shape"):
        compute_kl(x, torch.zeros(4), "k1")
