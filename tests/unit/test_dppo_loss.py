"""dppo_tv and dppo_kl (DPPO, arXiv:2602.04879) against per-token values, gradients and metrics computed
by hand from the paper's binary divergences, and their aggregation under every loss_agg_mode.

Tolerances: 1e-12 absolute in float64 (each reference is a few float operations away)."""

from __future__ import annotations

import math

import pytest
import torch

from rlsp.algos.aggregation import AGGREGATION_MODES, LossScale, aggregate_loss
from rlsp.algos.dppo import compute_dppo_kl_loss, compute_dppo_tv_loss
from rlsp.algos.registry import get_policy_loss

F64 = torch.float64
# (old prob, new prob, advantage, mask): rare tokens with large ratios, likely tokens with large moves,
# both advantage signs, an A == 0 token, masked-out tokens (one with a huge ratio).
TOKENS = [(1e-5, 1e-3, 1.0, 1), (0.99, 0.80, -1.0, 1), (0.99, 0.80, 1.0, 1), (0.30, 0.60, 2.0, 1),
          (0.30, 0.60, -0.5, 1), (0.50, 0.45, -1.5, 1), (0.50, 0.52, 0.7, 1), (0.20, 0.10, 1.2, 1),
          (0.05, 0.40, 0.0, 1), (0.01, 0.90, 3.0, 0), (0.40, 0.41, -2.0, 0)]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.tensor([math.log(t[0]) for t in TOKENS], dtype=F64)
    logprobs = torch.tensor([math.log(t[1]) for t in TOKENS], dtype=F64, requires_grad=True)
    adv = torch.tensor([t[2] for t in TOKENS], dtype=F64)
    mask = torch.tensor([t[3] for t in TOKENS], dtype=F64)
    return logprobs, old, adv, mask


def _keep_tv(p_old: float, p: float, a: float, low: float, high: float) -> bool:
    return p - p_old <= high if a > 0 else p - p_old >= -low


def _keep_kl(p_old: float, p: float, a: float, low: float, high: float) -> bool:
    kl = p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    return (kl <= high or p <= p_old) if a > 0 else (kl <= low or p >= p_old)


@pytest.mark.parametrize("name,fn,keep_fn", [("dppo_tv", compute_dppo_tv_loss, _keep_tv),
                                             ("dppo_kl", compute_dppo_kl_loss, _keep_kl)])
@pytest.mark.parametrize("low,high,c", [(0.15, 0.15, 3.0), (0.05, 0.05, 20.0), (0.1, 0.3, 1.5)])
def test_values_gradients_and_metrics_by_hand(name, fn, keep_fn, low: float, high: float, c: float) -> None:
    assert get_policy_loss(name) is fn
    logprobs, old, adv, mask = _inputs()
    loss, metrics = fn(logprobs, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    masked_out = truncated = 0
    kl_sum = 0.0
    for i, (p_old, p, a, m) in enumerate(TOKENS):
        keep = keep_fn(p_old, p, a, low, high)
        weight = min(p / p_old, c) * keep
        assert loss[i].item() == (pytest.approx(-a * weight * math.log(p), abs=1e-12) if m else 0.0)
        assert grad[i].item() == (pytest.approx(-a * weight, abs=1e-12) if m else 0.0)
        if m:
            masked_out += not keep
            truncated += keep and p / p_old > c
            kl_sum += math.log(p_old / p)
    n = sum(t[3] for t in TOKENS)
    assert metrics["num_tokens"].item() == n
    assert metrics["pg_clipfrac_sum"].item() == masked_out and masked_out > 0
    assert metrics["pg_clipfrac"].item() == pytest.approx(masked_out / n, abs=1e-12)
    assert metrics["pg_clipfrac_lower_sum"].item() == truncated
    assert metrics["ppo_kl"].item() == pytest.approx(kl_sum / n, abs=1e-12)


def test_tv_and_kl_regions_differ_where_the_paper_says() -> None:
    """The rare token (1e-5 -> 1e-3, ratio 100) stays in both trust regions (PPO would clip it); the likely
    token's drop 0.99 -> 0.80 under A < 0 leaves both (PPO's ratio 0.81 would keep it)."""
    logprobs, old, adv, mask = _inputs()
    for fn in (compute_dppo_tv_loss, compute_dppo_kl_loss):
        _, m = fn(logprobs[:2], old[:2], adv[:2], mask[:2], clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=1e4)
        assert m["pg_clipfrac_sum"].item() == 1.0  # only the likely token's drop is masked out
    tv_keep = _keep_tv(0.99, 0.80, -1.0, 0.15, 0.15)
    kl_keep = _keep_kl(0.99, 0.80, -1.0, 0.05, 0.05)
    assert not tv_keep and not kl_keep


def test_large_clip_ratio_c_disables_truncation() -> None:
    logprobs, old, adv, mask = _inputs()
    _, metrics = compute_dppo_tv_loss(logprobs, old, adv, mask, clip_ratio_low=1.0, clip_ratio_high=1.0,
                                      clip_ratio_c=1e4)
    assert metrics["pg_clipfrac_sum"].item() == 0.0 and metrics["pg_clipfrac_lower_sum"].item() == 0.0


@pytest.mark.parametrize("fn", [compute_dppo_tv_loss, compute_dppo_kl_loss])
def test_bad_thresholds_refused(fn) -> None:
    logprobs, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="divergence thresholds"):
        fn(logprobs, old, adv, mask, clip_ratio_low=-0.1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        fn(logprobs, old, adv, mask, clip_ratio_c=0.0)


def _agg_by_hand(loss_rows: list[list[float]], mask_rows: list[list[int]], mode: str) -> float:
    """verl's agg_loss of one batch, written out per row."""
    rows = [(sum(v * m for v, m in zip(lr, mr)), sum(mr)) for lr, mr in zip(loss_rows, mask_rows)]
    seqs = sum(1 for _, n in rows if n > 0)
    if mode == "token-mean":
        return sum(s for s, _ in rows) / sum(n for _, n in rows)
    if mode == "seq-mean-token-sum":
        return sum(s for s, n in rows if n) / seqs
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in rows if n) / seqs
    return sum(s for s, _ in rows) / (seqs * len(loss_rows[0]))


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("fn", [compute_dppo_tv_loss, compute_dppo_kl_loss])
def test_aggregation_every_mode(fn, mode: str) -> None:
    logprobs, old, adv, mask = _inputs()
    shape = (2, 5)  # the first ten tokens as two rows of five
    lp = logprobs.detach()[:10].reshape(shape).clone().requires_grad_(True)
    o, a, m = old[:10].reshape(shape), adv[:10].reshape(shape), mask[:10].reshape(shape)
    loss, _ = fn(lp, o, a, m, clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=3.0)
    tokens, seqs = float(m.sum()), float((m.sum(-1) > 0).sum())
    total = aggregate_loss(loss, m, LossScale(mode, tokens, seqs))
    (grad,) = torch.autograd.grad(total, lp, retain_graph=True)
    expected = _agg_by_hand(loss.detach().tolist(), m.int().tolist(), mode)
    assert total.item() == pytest.approx(expected, abs=1e-12)
    # d total / d logp_t = (d loss_t / d logp_t) x the token's share in the aggregate, by hand.
    (token_grad,) = torch.autograd.grad(loss.sum(), lp)
    for r in range(2):
        n = float(m[r].sum())
        share = {"token-mean": 1 / tokens, "seq-mean-token-sum": 1 / seqs,
                 "seq-mean-token-mean": 1 / (seqs * max(n, 1.0)), "seq-mean-token-sum-norm": 1 / (seqs * 5)}[mode]
        for t in range(5):
            want = token_grad[r, t].item() * share if m[r, t] else 0.0
            assert grad[r, t].item() == pytest.approx(want, abs=1e-12)
