"""clip_cov and kl_cov (arXiv:2505.22617) against per-token values, gradients, picks and metrics computed
by hand from the paper's covariance, and their aggregation under every loss_agg_mode.

Tolerances: 1e-12 absolute in float64."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from rlsp.algos.aggregation import AGGREGATION_MODES, LossScale, aggregate_loss
from rlsp.algos.clip_cov import compute_clip_cov_loss
from rlsp.algos.cov_select import pick_clip_cov, pick_count, pick_top_cov, selection_seed
from rlsp.algos.kl_cov import compute_kl_cov_loss
from rlsp.algos.registry import get_policy_loss
from rlsp.check import run_checks
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config

F64 = torch.float64
B, R = 3, 6
# Per row: (ratios, old logprobs, advantage, mask). Large |A| rows and spread logprobs give covariances
# on both sides of [0.05, 5]; ratios outside [0.8, 1.2] put some tokens in PPO's clip.
ROWS = [([1.0, 1.1, 1.5, 0.9, 1.0, 1.3], [-0.1, -2.0, -0.3, -4.0, -0.05, -1.0], 2.0, [1, 1, 1, 1, 1, 0]),
        ([1.0, 0.7, 1.05, 1.0, 0.95, 1.0], [-3.0, -0.2, -5.0, -0.4, -2.5, -1.0], -1.5, [1, 1, 1, 1, 1, 1]),
        ([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [-1.0, -1.5, -0.7, -2.0, -1.2, -3.0], 0.3, [1, 1, 1, 0, 0, 0])]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ratio = torch.tensor([r[0] for r in ROWS], dtype=F64)
    old = torch.tensor([r[1] for r in ROWS], dtype=F64)
    logprobs = (old + torch.log(ratio)).requires_grad_(True)
    adv = torch.tensor([[r[2]] * R for r in ROWS], dtype=F64)
    mask = torch.tensor([r[3] for r in ROWS], dtype=F64)
    return logprobs, old, adv, mask


def _tokens() -> list[tuple[int, float, float, float, int]]:
    """(canonical index, ratio, logp, A, mask) per token, row-major."""
    out = []
    for b, (ratios, olds, a, mask) in enumerate(ROWS):
        for t in range(R):
            out.append((b * R + t, ratios[t], olds[t] + math.log(ratios[t]), a, mask[t]))
    return out


def _cov_by_hand() -> dict[int, float]:
    on = [tok for tok in _tokens() if tok[4]]
    mean_a = sum(tok[3] for tok in on) / len(on)
    mean_lp = sum(tok[2] for tok in on) / len(on)
    return {i: (a - mean_a) * (lp - mean_lp) for i, _, lp, a, _ in on}


def _ppo(ratio: float, a: float, low: float, high: float) -> tuple[float, float, bool]:
    """(loss, d loss / d logp, clip range binds) of PPO's clipped surrogate (no dual clip)."""
    clipped = min(max(ratio, 1 - low), 1 + high)
    binds = -a * clipped > -a * ratio
    return (-a * clipped, 0.0, True) if binds else (-a * ratio, -a * ratio, False)


@pytest.mark.parametrize("fraction", [1.0, 0.1])
def test_clip_cov_values_gradients_picks_and_metrics(fraction: float) -> None:
    assert get_policy_loss("clip_cov") is compute_clip_cov_loss
    logprobs, old, adv, mask = _inputs()
    lb, ub = 0.05, 5.0
    loss, metrics = compute_clip_cov_loss(logprobs, old, adv, mask, clip_cov_ratio=fraction, clip_cov_lb=lb,
                                          clip_cov_ub=ub)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    cov = _cov_by_hand()
    n = len(cov)
    candidates = [i for i, r, _, a, _ in _tokens() if i in cov and not _ppo(r, a, 0.2, 0.2)[2] and lb < cov[i] < ub]
    count = max(int(fraction * n), 1)
    # A token outside the clip keeps the gradient -A r != 0 (every A here is non-zero) unless it was picked.
    picked = {i for i, r, _, a, _ in _tokens() if i in cov and not _ppo(r, a, 0.2, 0.2)[2] and grad.reshape(-1)[i] == 0}
    assert len(candidates) >= 3 and set(picked) <= set(candidates)
    assert len(picked) == min(count, len(candidates))
    if count >= len(candidates):
        assert picked == set(candidates)
    for i, ratio, _, a, m in _tokens():
        want_loss, want_grad, _ = _ppo(ratio, a, 0.2, 0.2)
        if i in picked or not m:
            want_loss = want_grad = 0.0
        assert loss.reshape(-1)[i].item() == pytest.approx(want_loss, abs=1e-12)
        assert grad.reshape(-1)[i].item() == pytest.approx(want_grad, abs=1e-12)
    assert metrics["num_tokens"].item() == n
    assert metrics["pg_clipfrac"].item() == pytest.approx(len(picked) / n, abs=1e-12)
    kl = sum(-math.log(r) for i, r, _, _, _ in _tokens() if i in cov)
    assert metrics["ppo_kl"].item() == pytest.approx(kl / n, abs=1e-12)
    assert "pg_clipfrac_lower" not in metrics  # verl reports none for clip_cov


def test_clip_cov_draw_is_deterministic_uniform_and_shared() -> None:
    cov_N = torch.arange(40, dtype=F64)
    cand = (torch.arange(40) % 3 == 0).to(F64)
    adv, mask = torch.linspace(-1, 1, 40, dtype=F64), torch.ones(40, dtype=F64)
    seed = selection_seed(adv, mask)
    assert seed == selection_seed(adv.clone(), mask.to(torch.float32))  # bytes of the values, not the dtype
    assert seed != selection_seed(adv.flip(0), mask)
    first = pick_clip_cov(cov_N, cand, 4, seed)
    assert torch.equal(first, pick_clip_cov(cov_N, cand, 4, seed))
    assert int(first.sum()) == 4 and bool((first <= cand.bool()).all())
    hits = torch.zeros(40)
    for s in range(600):  # every candidate is drawn, about 4/14 of the time
        hits += pick_clip_cov(cov_N, cand, 4, s).to(hits.dtype)
    rate = hits[cand.bool()] / 600
    assert float(hits[~cand.bool()].sum()) == 0.0 and float((rate - 4 / 14).abs().max()) < 0.08


@pytest.mark.parametrize("fraction,coef", [(0.2, 0.1), (0.5, 1.0), (1e-4, 0.3)])
def test_kl_cov_values_gradients_picks_and_metrics(fraction: float, coef: float) -> None:
    assert get_policy_loss("kl_cov") is compute_kl_cov_loss
    logprobs, old, adv, mask = _inputs()
    loss, metrics = compute_kl_cov_loss(logprobs, old, adv, mask, kl_cov_ratio=fraction, ppo_kl_coef=coef)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    cov = _cov_by_hand()
    n = len(cov)
    k = max(1, int(n * fraction))
    top = set(sorted(cov, key=lambda i: (-cov[i], i))[:k])
    abs_sum = 0.0
    for i, ratio, _, a, m in _tokens():
        lr = math.log(ratio)
        want_loss, want_grad = -a * ratio, -a * ratio
        if i in top:
            want_loss += coef * abs(lr)
            want_grad += coef * (1.0 if lr > 0 else -1.0 if lr < 0 else 0.0)  # d|x|/dx, torch's sign(0) = 0
        if not m:
            want_loss = want_grad = 0.0
        else:
            abs_sum += abs(lr)
        assert loss.reshape(-1)[i].item() == pytest.approx(want_loss, abs=1e-12)
        assert grad.reshape(-1)[i].item() == pytest.approx(want_grad, abs=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(abs_sum / n, abs=1e-12)
    assert set(metrics) == {"num_tokens", "ppo_kl", "ppo_kl_sum"}


def test_top_cov_ties_go_to_the_earlier_token() -> None:
    cov = torch.tensor([1.0, 3.0, 3.0, -2.0, 3.0], dtype=F64)
    valid = torch.tensor([1, 1, 1, 1, 0], dtype=F64)
    assert pick_top_cov(cov, valid, 1).tolist() == [False, True, False, False, False]
    assert pick_top_cov(cov, valid, 9).tolist() == [True, True, True, True, False]
    assert pick_count(10_000, 0.0002) == 2 and pick_count(100, 0.0002) == 1


def test_bad_settings_refused() -> None:
    logprobs, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        compute_clip_cov_loss(logprobs, old, adv, mask, clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="clip_cov_lb"):
        compute_clip_cov_loss(logprobs, old, adv, mask, clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        compute_kl_cov_loss(logprobs, old, adv, mask, kl_cov_ratio=1.5)
    with pytest.raises(ValueError, match="ppo_kl_coef"):
        compute_kl_cov_loss(logprobs, old, adv, mask, ppo_kl_coef=-1.0)


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
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_aggregation_every_mode(name: str, mode: str) -> None:
    logprobs, old, adv, mask = _inputs()
    kwargs = {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.05} if name == "clip_cov" else {"kl_cov_ratio": 0.3}
    loss, _ = get_policy_loss(name)(logprobs, old, adv, mask, **kwargs)
    tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    total = aggregate_loss(loss, mask, LossScale(mode, tokens, seqs))
    (grad,) = torch.autograd.grad(total, logprobs, retain_graph=True)
    (token_grad,) = torch.autograd.grad(loss.sum(), logprobs)
    assert total.item() == pytest.approx(_agg_by_hand(loss.detach().tolist(), mask.int().tolist(), mode), abs=1e-12)
    for b in range(B):
        n = float(mask[b].sum())
        share = {"token-mean": 1 / tokens, "seq-mean-token-sum": 1 / seqs,
                 "seq-mean-token-mean": 1 / (seqs * n), "seq-mean-token-sum-norm": 1 / (seqs * R)}[mode]
        for t in range(R):
            want = token_grad[b, t].item() * share if mask[b, t] else 0.0
            assert grad[b, t].item() == pytest.approx(want, abs=1e-12)


def _cfg(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
                     "actor_rollout_ref.rollout.n": 2, "trainer.n_gpus_per_node": 1, **overrides}.items():
        OmegaConf.update(cfg, key, val)
    return cfg


PL = "actor_rollout_ref.actor.policy_loss."


@pytest.mark.parametrize("overrides,message", [
    ({"clip_cov_ratio": 0.0}, r"policy_loss.clip_cov_ratio=0.0 must be in \(0, 1\]"),
    ({"loss_mode": "kl_cov", "kl_cov_ratio": 2.0}, r"policy_loss.kl_cov_ratio=2.0 must be in \(0, 1\]"),
    ({"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "clip_cov_lb=5.0 must be < actor_rollout_ref.actor.policy_loss.clip_cov_ub=1.0"),
    ({"loss_mode": "kl_cov", "ppo_kl_coef": -0.1}, "ppo_kl_coef=-0.1 must be >= 0"),
    ({"loss_mode": "kl_cov", "clip_cov_ub": 9.0}, "clip_cov_ub=9.0 has no effect with .*loss_mode='kl_cov'.*\\['clip_cov'\\]"),
])
def test_start_up_refuses_bad_settings(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(**{PL + k: v for k, v in overrides.items()}))


@pytest.mark.parametrize("args", [
    [f"{PL}loss_mode=clip_cov", f"{PL}clip_cov_ratio=0.0002", f"{PL}clip_cov_lb=1.0", f"{PL}clip_cov_ub=5.0",
     "actor_rollout_ref.actor.clip_ratio_high=0.28"],
    [f"{PL}loss_mode=kl_cov", f"{PL}kl_cov_ratio=0.002", f"{PL}ppo_kl_coef=1.0"],
    [f"{PL}loss_mode=dppo_tv", "actor_rollout_ref.actor.clip_ratio=0.15", "actor_rollout_ref.actor.clip_ratio_c=10000"],
    [f"{PL}loss_mode=dppo_kl", "actor_rollout_ref.actor.clip_ratio_low=0.05", "actor_rollout_ref.actor.clip_ratio_high=0.05"],
    ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce",
     "algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
     "algorithm.rollout_correction.rollout_rs_threshold=0.999_1.001"],
])
def test_rlsp_check_accepts_the_losses_with_their_keys(args: list[str], tmp_path) -> None:
    report = run_checks(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                         f"trainer.default_local_dir={tmp_path / 'run'}", *args])
    assert report.problems == [], report.render()
