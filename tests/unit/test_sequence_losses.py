"""gspo, geo_mean and sapo against values computed by hand from each paper's formula (plain Python floats):
every element of the loss and of its gradient w.r.t. the logprobs, the metrics, and the aggregated loss and
gradient under all four loss_agg_modes. The sequence-level ones are also checked against their papers'
sequence objectives differentiated by autograd. Tolerances: 1e-12 absolute in float64."""

from __future__ import annotations

import math

import pytest
import torch

from rlsp.algos.aggregation import AGGREGATION_MODES, LossScale, aggregate_loss
from rlsp.algos.geo_mean import compute_geo_mean_loss
from rlsp.algos.gspo import compute_gspo_loss
from rlsp.algos.sapo import compute_sapo_loss

F64 = torch.float64
TOL = 1e-12
# Rows of (log-ratio x_t = logp_t - old_logp_t, advantage A_t); rows of 4, 2, 0 and 3 response tokens (R = 4).
GSPO_ROWS = [  # GRPO-like: one advantage per row; row means of x: 1e-4, 1e-3, (empty), -1e-3
    [(3e-4, 1.0), (-2e-4, 1.0), (1e-4, 1.0), (2e-4, 1.0)],
    [(1.5e-3, 2.0), (5e-4, 2.0)],
    [],
    [(-2e-3, 0.5), (0.0, 0.5), (-1e-3, 0.5)],
]
CLIP_LOW, CLIP_HIGH = 3e-4, 4e-4  # the GSPO paper's
GMPO_ROWS = [  # per-token advantages of both signs (and a zero) exercise the sign-dependent clip
    [(0.3, 1.0), (-0.5, 1.0), (0.1, -1.0), (-0.3, 0.5)],
    [(0.25, -2.0), (-0.25, -2.0)],
    [],
    [(0.05, 0.0), (0.6, 1.5), (-0.1, -0.5)],
]
SAPO_ROWS = [
    [(0.3, 1.0), (-0.5, 1.0), (0.1, -1.0), (-0.3, 0.5)],
    [(1.2, -2.0), (-2.0, 2.0)],
    [],
    [(0.0, 1.0), (0.0, -1.0), (25.0, -0.5)],  # 25 is clamped to 20 before exp (no gradient)
]
OLD = [-1.0, -0.5, -2.0, -1.5]


def _tensors(rows):
    """(logprobs [B, R] requiring grad, old, advantages, mask) from rows of (x_t, A_t); masked slots get junk."""
    B, R = len(rows), 4
    old = torch.tensor([OLD] * B, dtype=F64)
    x = torch.full((B, R), 7.0, dtype=F64)
    adv = torch.full((B, R), 3.0, dtype=F64)
    mask = torch.zeros(B, R, dtype=F64)
    for b, row in enumerate(rows):
        for t, (xt, at) in enumerate(row):
            x[b, t], adv[b, t], mask[b, t] = xt, at, 1.0
    return (old + x).requires_grad_(True), old, adv, mask


def _grid(rows, fn):
    """[B][R] of fn(b, t) for response tokens, 0.0 elsewhere."""
    return [[fn(b, t) if t < len(row) else 0.0 for t in range(4)] for b, row in enumerate(rows)]


def gspo_by_hand(rows):
    """Per-token loss and d loss_t / d logp_t: s_i = exp(mean_t x_t); loss = max(-A s, -A clip(s)); the
    gradient is -A s_i where the unclipped term is the loss, 0 where the clip bounds it."""
    s = [math.exp(sum(x for x, _ in row) / len(row)) if row else 1.0 for row in rows]

    def loss(b, t):
        a = rows[b][t][1]
        return max(-a * s[b], -a * min(max(s[b], 1 - CLIP_LOW), 1 + CLIP_HIGH))

    def grad(b, t):
        a = rows[b][t][1]
        clipped = -a * min(max(s[b], 1 - CLIP_LOW), 1 + CLIP_HIGH) > -a * s[b]
        return 0.0 if clipped else -a * s[b]

    return _grid(rows, loss), _grid(rows, grad)


def gmpo_by_hand(rows):
    """c_t = min(x, eps_high) for A > 0, max(x, -eps_low) for A < 0, 0 for A = 0; L_i = -mean(A) exp(mean(c));
    per-token value L_i and gradient L_i * dc_t/dx_t (1 inside the one-sided bound, else 0)."""
    low = high = 0.2

    def c(x, a):
        return min(x, high) if a > 0 else max(x, -low) if a < 0 else 0.0

    def dc(x, a):
        return 1.0 if (a > 0 and x < high) or (a < 0 and x > -low) else 0.0

    L = [-(sum(a for _, a in row) / len(row)) * math.exp(sum(c(x, a) for x, a in row) / len(row)) if row else 0.0
         for row in rows]
    return _grid(rows, lambda b, t: L[b]), _grid(rows, lambda b, t: L[b] * dc(*rows[b][t]))


def sapo_by_hand(rows, tau_pos=1.0, tau_neg=1.05):
    """loss = -A sigmoid(tau (r - 1)) 4 / tau; gradient -A r 4 sigma (1 - sigma) (0 where x is clamped)."""
    def parts(b, t):
        x, a = rows[b][t]
        tau = tau_pos if a > 0 else tau_neg
        r = math.exp(max(min(x, 20.0), -20.0))
        sig = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
        return a, tau, r, sig, abs(x) > 20.0

    def loss(b, t):
        a, tau, _, sig, _ = parts(b, t)
        return -a * sig * 4.0 / tau

    def grad(b, t):
        a, _, r, sig, clamped = parts(b, t)
        return 0.0 if clamped else -a * r * 4.0 * sig * (1.0 - sig)

    return _grid(rows, loss), _grid(rows, grad)


CASES = {
    "gspo": (compute_gspo_loss, GSPO_ROWS, gspo_by_hand, {"clip_ratio_low": CLIP_LOW, "clip_ratio_high": CLIP_HIGH}),
    "geo_mean": (compute_geo_mean_loss, GMPO_ROWS, gmpo_by_hand, {}),
    "sapo": (compute_sapo_loss, SAPO_ROWS, sapo_by_hand, {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_element_of_loss_and_gradient_by_hand(name: str) -> None:
    fn, rows, by_hand, kwargs = CASES[name]
    logprobs, old, adv, mask = _tensors(rows)
    loss, _ = fn(logprobs, old, adv, mask, **kwargs)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    want_loss, want_grad = by_hand(rows)
    torch.testing.assert_close(loss, torch.tensor(want_loss, dtype=F64), rtol=0, atol=TOL)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=F64), rtol=0, atol=TOL)
    assert torch.all(loss[mask == 0] == 0.0)


def test_the_cases_exercise_both_branches() -> None:
    """The hand values above include clipped and unclipped tokens (else the gradient check is weak)."""
    for name in ("gspo", "geo_mean"):
        _, rows, by_hand, _ = CASES[name]
        grads = [g for row, grow in zip(rows, by_hand(rows)[1], strict=True) for g in grow[: len(row)]]
        assert any(g == 0.0 for g in grads) and any(g != 0.0 for g in grads), name


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_aggregated_loss_and_gradient_under_every_mode(name: str, mode: str) -> None:
    """sum_t w_t loss_t / D with verl's weights and divisor, by hand, for value and gradient."""
    fn, rows, by_hand, kwargs = CASES[name]
    logprobs, old, adv, mask = _tensors(rows)
    loss_tokens, _ = fn(logprobs, old, adv, mask, **kwargs)
    seqs, horizon = sum(1 for row in rows if row), 4
    total = aggregate_loss(loss_tokens, mask, LossScale(mode, float(mask.sum()), float(seqs)))
    (grad,) = torch.autograd.grad(total, logprobs)
    want_loss, want_grad = by_hand(rows)
    divisor = {"token-mean": float(mask.sum()), "seq-mean-token-sum": seqs, "seq-mean-token-mean": seqs,
               "seq-mean-token-sum-norm": seqs * horizon}[mode]
    weight = [[(1.0 / len(row) if mode == "seq-mean-token-mean" else 1.0) if t < len(row) else 0.0 for t in range(4)]
              for row in rows]
    value = sum(w * v for wr, vr in zip(weight, want_loss, strict=True) for w, v in zip(wr, vr, strict=True)) / divisor
    assert total.item() == pytest.approx(value, abs=TOL)
    want = torch.tensor(want_grad, dtype=F64) * torch.tensor(weight, dtype=F64) / divisor
    torch.testing.assert_close(grad, want, rtol=0, atol=TOL)


def _paper_gspo(logprobs, old, adv, mask):
    """GSPO eq. 5: -(1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(masked mean of the log-ratio)."""
    keep = mask.sum(-1) > 0
    s = torch.exp(((logprobs - old) * mask).sum(-1) / mask.sum(-1).clamp_min(1.0))
    a = (adv * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    j = torch.minimum(s * a, s.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
    return -(j * keep).sum() / keep.sum()


def _paper_gmpo(logprobs, old, adv, mask):
    """GMPO eq. 4: -(1/G) sum_i A_i prod_t (clipped r_t)^(1/|y_i|), the product taken in log space."""
    keep = mask.sum(-1) > 0
    x = logprobs - old
    c = torch.where(adv > 0, torch.clamp(x, max=0.2), torch.where(adv < 0, torch.clamp(x, min=-0.2), x * 0.0))
    n = mask.sum(-1).clamp_min(1.0)
    seq = -(adv * mask).sum(-1) / n * torch.exp((c * mask).sum(-1) / n)
    return (seq * keep).sum() / keep.sum()


@pytest.mark.parametrize("name,paper", [("gspo", _paper_gspo), ("geo_mean", _paper_gmpo)])
def test_seq_mean_token_mean_equals_the_papers_sequence_objective(name: str, paper) -> None:
    fn, rows, _, kwargs = CASES[name]
    logprobs, old, adv, mask = _tensors(rows)
    loss_tokens, _ = fn(logprobs, old, adv, mask, **kwargs)
    seqs = float(sum(1 for row in rows if row))
    ours = aggregate_loss(loss_tokens, mask, LossScale("seq-mean-token-mean", float(mask.sum()), seqs))
    (grad_ours,) = torch.autograd.grad(ours, logprobs)
    theirs = paper(logprobs, old, adv, mask)
    (grad_paper,) = torch.autograd.grad(theirs, logprobs)
    assert ours.item() == pytest.approx(theirs.item(), abs=TOL)
    torch.testing.assert_close(grad_ours * mask, grad_paper * mask, rtol=0, atol=TOL)


def test_metrics_are_verls_by_hand() -> None:
    logprobs, old, adv, mask = _tensors(GSPO_ROWS)
    _, m = compute_gspo_loss(logprobs, old, adv, mask, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH)
    # Clip binds (the clipped term is the larger loss) for row 1 (s > 1 + high, A > 0) only; row 3 (s < 1 - low,
    # A > 0) keeps its unclipped loss.
    assert m["num_tokens"].item() == 9 and m["pg_clipfrac_sum"].item() == 2.0
    assert m["pg_clipfrac_lower_sum"].item() == 0.0
    kl = -sum(x for row in GSPO_ROWS for x, _ in row)
    assert m["ppo_kl_sum"].item() == pytest.approx(kl, abs=TOL) and m["ppo_kl"].item() == pytest.approx(kl / 9, abs=TOL)
    logprobs, old, adv, mask = _tensors(GMPO_ROWS)
    _, m = compute_geo_mean_loss(logprobs, old, adv, mask)
    # |x| > 0.2 with A > 0: 0.3 and -0.5 (row 0), -0.3 (row 0), 0.6 (row 3); with A < 0: 0.25, -0.25 (row 1).
    assert m["pg_clipfrac_sum"].item() == 4.0 and m["pg_clipfrac_lower_sum"].item() == 2.0
    logprobs, old, adv, mask = _tensors(SAPO_ROWS)
    _, m = compute_sapo_loss(logprobs, old, adv, mask)
    assert m["pg_clipfrac_sum"].item() == 0.0 and m["pg_clipfrac_lower_sum"].item() == 0.0
    kl = -sum(max(min(x, 20.0), -20.0) for row in SAPO_ROWS for x, _ in row)
    assert m["ppo_kl_sum"].item() == pytest.approx(kl, abs=TOL)
    assert all(not v.requires_grad for v in m.values())


def test_sapo_temperatures_and_its_on_policy_gradient() -> None:
    """At r = 1 the gate's gradient is the plain policy gradient -A whatever tau; tau only scales the value."""
    for tau_pos, tau_neg in ((1.0, 1.05), (0.5, 3.0)):
        logprobs, old, adv, mask = _tensors([[(0.0, 2.0), (0.0, -1.0)]])
        loss, _ = compute_sapo_loss(logprobs, old, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg)
        (grad,) = torch.autograd.grad(loss.sum(), logprobs)
        torch.testing.assert_close(grad[0, :2], torch.tensor([-2.0, 1.0], dtype=F64), rtol=0, atol=TOL)
        torch.testing.assert_close(loss[0, :2], torch.tensor([-4.0 / tau_pos, 2.0 / tau_neg], dtype=F64), rtol=0,
                                   atol=TOL)
    rows = [[(0.4, 1.0), (-0.4, -1.0), (1.0, -1.0)]]
    logprobs, old, adv, mask = _tensors(rows)
    loss, _ = compute_sapo_loss(logprobs, old, adv, mask, tau_pos=0.5, tau_neg=3.0)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    want_loss, want_grad = sapo_by_hand(rows, 0.5, 3.0)
    torch.testing.assert_close(loss, torch.tensor(want_loss, dtype=F64), rtol=0, atol=TOL)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=F64), rtol=0, atol=TOL)


@pytest.mark.parametrize("fn,kwargs,needle", [
    (compute_gspo_loss, {"clip_ratio_low": 1.0}, "gspo needs 0 <= clip_ratio_low < 1"),
    (compute_geo_mean_loss, {"clip_ratio_high": -0.1}, "log-ratio bounds, which must be >= 0"),
    (compute_sapo_loss, {"tau_neg": 0.0}, "tau_pos=1.0, tau_neg=0.0"),
])
def test_illegal_settings_are_refused(fn, kwargs: dict, needle: str) -> None:
    logprobs, old, adv, mask = _tensors(GSPO_ROWS)
    with pytest.raises(ValueError, match=needle):
        fn(logprobs, old, adv, mask, **kwargs)


def test_sequence_losses_need_rows_or_a_context() -> None:
    logprobs, old, adv, mask = _tensors(GSPO_ROWS)
    with pytest.raises(ValueError, match="needs rows"):
        compute_gspo_loss(logprobs.reshape(-1), old.reshape(-1), adv.reshape(-1), mask.reshape(-1))
