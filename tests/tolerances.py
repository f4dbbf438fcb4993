"""Bounds for comparing two computations of the same numbers: a parallel layout against one rank, a resumed
run against a continued one, a fused kernel against the plain one. Every test that compares an optimizer
step, a gradient or a logprob computed two ways takes its bound from here, never a fixed constant.

Derivation (u is the dtype's unit roundoff: 2^-24 in fp32, 2^-8 in bf16, 2^-53 in fp64):

1. Reductions in another order. A sum of n terms carries a rounding error of at most (n-1) u sum|x_i|
   (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2); the errors of the individual additions
   have zero mean and are independent enough that the error grows as sqrt(n) u sum|x_i| (Higham & Mary,
   "A new approach to probabilistic rounding error analysis", 2019). Two layouts differ in the order of
   their sums (tokens split over ranks and micro-batches, heads over ranks, blocks merged by log-sum-exp),
   so their results differ by about that much twice. A network chains such reductions: each layer's
   projections, attention scores and weighted values, the MLP, the vocabulary's log-sum-exp, and the same
   again backwards; the relative errors of chained stages add. `roundoff_rtol` is that sum, times TWO for
   the two computations that each carry their own error (small random models are well conditioned: their
   logits are O(1), so no conditioning factor is added).
   A layout bug (a token, head or gradient shard lost or counted twice) moves a result by O(1e-2) or more,
   orders of magnitude above these bounds, so they keep the tests' power.

2. AdamW's first step. With m_hat = g and v_hat = g^2 the step moves a parameter by lr * f(g),
   f(g) = g / (|g| + eps), after the decay p * (1 - lr * wd) that both computations share. f is monotone
   with |f'(x)| = eps / (|x| + eps)^2, largest at the x of [g_ref, g] nearest 0 (0 itself when the signs
   differ), so two gradients that agree to fp32 roundoff give steps that differ by at most
   lr * |g - g_ref| * eps / (nearest + eps)^2: an element within ~eps = 1e-8 of 0 amplifies its roundoff by
   up to lr / eps (1e5 at lr 1e-3). Which element sits there, and how its roundoff falls, depends on the
   CPU's summation kernels: this is why a fixed tolerance on a step passes on one machine and fails on
   another. The step's own rounding adds a few units in the last place of |p| and of the update (lr).
   `adam_step_bound` returns that bound per element from the gradients both computations actually used;
   `assert_adam_step_close` checks every element of every parameter against it.

3. bf16. Rounding a value to bf16 moves it by up to u_bf16 |x| = 2^-8 |x|; a bf16 computation compared with
   fp32 uses `roundoff_rtol(..., dtype=torch.bfloat16)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

TWO = 2.0  # both computations carry their own rounding error
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which rlsp's optimizer keeps
STEP_ULPS = 4  # rounding of the decay, the division and the update inside one AdamW step


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u: half the distance from 1 to the next representable number."""
    return torch.finfo(dtype).eps / 2


def roundoff_rtol(*, reduction: int, stages: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative difference two evaluations may show that differ only in the order of `stages` chained
    reductions of at most `reduction` terms each (derivation 1)."""
    if reduction < 1 or stages < 1:
        raise ValueError(f"reduction={reduction} and stages={stages} must be >= 1")
    return TWO * stages * math.sqrt(reduction) * unit_roundoff(dtype)


def model_rtol(config, tokens: int, *, backward: bool = True, dtype: torch.dtype = torch.float32) -> float:
    """`roundoff_rtol` for a decoder given by its HF `config` over `tokens` packed tokens: four reduction
    stages per layer (projections, scores, weighted values, MLP) plus the head's, doubled when the
    backward pass (gradients) is compared; the longest reduction is over the width, the tokens (attention;
    a weight gradient sums over all tokens) or the vocabulary."""
    width = max(config.hidden_size, getattr(config, "intermediate_size", 0) or 0)
    reduction = max(width, tokens, config.vocab_size)
    stages = (4 * config.num_hidden_layers + 1) * (2 if backward else 1)
    return roundoff_rtol(reduction=reduction, stages=stages, dtype=dtype)


def scalar_tol(value_scale: float, rtol: float) -> float:
    """Absolute bound for a scalar (a loss metric, a mean logprob) whose summed terms are of size
    `value_scale`: a loss near 0 from cancelling terms still carries the terms' roundoff."""
    return rtol * max(abs(value_scale), 1.0)


def adam_step_bound(g: torch.Tensor, g_ref: torch.Tensor, p_ref: torch.Tensor, lr: float,
                    eps: float = ADAM_EPS) -> torch.Tensor:
    """Per element, the largest difference AdamW's first step (no clipping) can leave between two copies of
    a parameter whose gradients were g and g_ref (derivation 2)."""
    g, g_ref = g.double(), g_ref.double()
    nearest = torch.where(g.sign() == g_ref.sign(), torch.minimum(g.abs(), g_ref.abs()), 0.0)
    amplified = lr * (g - g_ref).abs() * eps / (nearest + eps) ** 2
    ulp = torch.finfo(p_ref.dtype).eps
    return amplified + STEP_ULPS * ulp * (p_ref.double().abs() + lr)


def assert_adam_step_close(params: Mapping[str, torch.Tensor], ref_params: Mapping[str, torch.Tensor],
                           grads: Mapping[str, torch.Tensor], ref_grads: Mapping[str, torch.Tensor], lr: float,
                           eps: float = ADAM_EPS) -> None:
    """Every element of every parameter after one AdamW step within `adam_step_bound` of the reference's;
    the message names the worst element's parameter, difference and bound."""
    assert params.keys() == ref_params.keys() and len(params) > 0, (sorted(params), sorted(ref_params))
    worst = (0.0, "", 0.0, 0.0)
    for name, ref in ref_params.items():
        bound = adam_step_bound(grads[name], ref_grads[name], ref, lr, eps)
        err = (params[name].double() - ref.double()).abs()
        ratio = err / bound
        i = int(ratio.argmax())
        if ratio.flatten()[i] > worst[0]:
            worst = (float(ratio.flatten()[i]), name, float(err.flatten()[i]), float(bound.flatten()[i]))
    assert worst[0] <= 1.0, (f"AdamW step differs at {worst[1]}: {worst[2]:.3g} > bound {worst[3]:.3g} "
                             f"(ratio {worst[0]:.3g})")


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm of the difference over the reference's norm (the gradients' measure)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
