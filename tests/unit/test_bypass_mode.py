"""Rollout-correction bypass mode (algorithm.rollout_correction.bypass_mode / loss_type): the "bypass_mode"
loss against per-token values and gradients computed by hand (reinforce with token / sequence / no weights,
batch normalisation, rejection; ppo_clip), every loss_agg_mode, and the start-up checks and driver wiring.

Tolerances: 1e-12 absolute in float64."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from rlsp.algos.aggregation import AGGREGATION_MODES, LossScale, aggregate_loss
from rlsp.algos.bypass import compute_bypass_loss, rows_of_batch
from rlsp.algos.registry import get_policy_loss
from rlsp.config.run_spec import actor_policy_loss
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate_bypass import check_bypass_mode
from rlsp.step.off_policy import check_rollout_correction_names, rollout_correction_settings, uses_rollout_logprobs

F64 = torch.float64
R = 4
# Per row: (current logprobs, rollout logprobs, advantage, mask).
ROWS = [([-1.0, -0.5, -2.0, -0.3], [-1.1, -0.2, -2.5, -0.3], 1.5, [1, 1, 1, 0]),
        ([-0.7, -3.0, -0.1, -1.2], [-0.5, -2.0, -0.1, -1.0], -1.0, [1, 1, 1, 1]),
        ([-2.0, -0.4, -0.9, -5.0], [-2.2, -0.5, -0.6, -0.1], 0.5, [1, 1, 0, 0])]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.tensor([r[0] for r in ROWS], dtype=F64, requires_grad=True)
    rollout = torch.tensor([r[1] for r in ROWS], dtype=F64)
    adv = torch.tensor([[r[2]] * R for r in ROWS], dtype=F64)
    mask = torch.tensor([r[3] for r in ROWS], dtype=F64)
    return lp, rollout, adv, mask


def _token_weights(threshold: float) -> list[list[float]]:
    return [[min(math.exp(c - r), threshold) for c, r in zip(cur, rol)] for cur, rol, _, _ in ROWS]


def _seq_weights(threshold: float) -> list[list[float]]:
    out = []
    for cur, rol, _, mask in ROWS:
        w = min(math.exp(sum((c - r) * m for c, r, m in zip(cur, rol, mask))), threshold)
        out.append([w] * R)
    return out


def _check_reinforce(weights: list[list[float]], keep: list[list[int]], **kwargs) -> None:
    lp, rollout, adv, mask = _inputs()
    loss, metrics = compute_bypass_loss(lp, rollout, adv, mask, loss_type="reinforce", **kwargs)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    kl, n = 0.0, 0
    for b, (cur, rol, a, m) in enumerate(ROWS):
        for t in range(R):
            on = m[t] and keep[b][t]
            assert loss[b, t].item() == (pytest.approx(-a * weights[b][t] * cur[t], abs=1e-12) if on else 0.0)
            assert grad[b, t].item() == (pytest.approx(-a * weights[b][t], abs=1e-12) if on else 0.0)
            if on:
                kl, n = kl + rol[t] - cur[t], n + 1
    assert metrics["num_tokens"].item() == n
    assert metrics["ppo_kl"].item() == pytest.approx(kl / n, abs=1e-12)


ALL = [[1] * R for _ in ROWS]


def test_reinforce_without_weights_is_plain_policy_gradient() -> None:
    assert get_policy_loss("bypass_mode") is compute_bypass_loss
    _check_reinforce([[1.0] * R for _ in ROWS], ALL)


@pytest.mark.parametrize("threshold", [2.0, 1.2])
def test_reinforce_token_weights(threshold: float) -> None:
    _check_reinforce(_token_weights(threshold), ALL, rollout_is="token", rollout_is_threshold=threshold)


@pytest.mark.parametrize("threshold", [2.0, 0.9])
def test_reinforce_sequence_weights(threshold: float) -> None:
    _check_reinforce(_seq_weights(threshold), ALL, rollout_is="sequence", rollout_is_threshold=threshold)


def test_reinforce_batch_normalised_token_weights() -> None:
    w = _token_weights(2.0)
    on = [(b, t) for b, (_, _, _, m) in enumerate(ROWS) for t in range(R) if m[t]]
    mean = sum(w[b][t] for b, t in on) / len(on)
    _check_reinforce([[x / mean for x in row] for row in w], ALL, rollout_is="token", rollout_is_threshold=2.0,
                     rollout_is_batch_normalize=True)


def test_reinforce_batch_normalised_sequence_weights() -> None:
    w = _seq_weights(5.0)
    mean = sum(row[0] for row in w) / len(w)  # every row has tokens
    _check_reinforce([[x / mean for x in row] for row in w], ALL, rollout_is="sequence", rollout_is_threshold=5.0,
                     rollout_is_batch_normalize=True)


def test_reinforce_with_rejection() -> None:
    # token_k1 keeps 0.8 <= pi_rollout / pi_theta <= 1.25; seq_max_k2 rejects rows with a 0.5 l^2 > 0.3.
    keep_tok = [[int(0.8 <= math.exp(r - c) <= 1.25) for c, r in zip(cur, rol)] for cur, rol, _, _ in ROWS]
    _check_reinforce(_token_weights(2.0), keep_tok, rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")
    keep_row = [[int(max(0.5 * (c - r) ** 2 for c, r, m in zip(cur, rol, mask) if m) <= 0.3)] * R
                for cur, rol, _, mask in ROWS]
    assert [k[0] for k in keep_row] == [1, 0, 1]  # row 1 has |l| = 1; row 2's 0.5 l^2 = 12 at t = 3 is masked out
    _check_reinforce([[1.0] * R for _ in ROWS], keep_row, rollout_rs="seq_max_k2", rollout_rs_threshold=0.3)


def test_ppo_clip_is_the_clipped_ratio_to_the_rollout_policy() -> None:
    lp, rollout, adv, mask = _inputs()
    loss, metrics = compute_bypass_loss(lp, rollout, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                        clip_ratio_c=3.0)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    clipped = 0
    for b, (cur, rol, a, m) in enumerate(ROWS):
        for t in range(R):
            ratio = math.exp(cur[t] - rol[t])
            bound = min(max(ratio, 0.8), 1.28)
            use_clip = -a * bound > -a * ratio
            want = max(-a * ratio, -a * bound)
            want_grad = 0.0 if use_clip else -a * ratio
            if a < 0 and want > -a * 3.0:
                want, want_grad = -a * 3.0, 0.0
            assert loss[b, t].item() == (pytest.approx(want, abs=1e-12) if m[t] else 0.0)
            assert grad[b, t].item() == (pytest.approx(want_grad, abs=1e-12) if m[t] else 0.0)
            clipped += bool(m[t] and use_clip)
    assert metrics["pg_clipfrac_sum"].item() == clipped and clipped > 0


def test_ppo_clip_reports_importance_weights_without_applying_them() -> None:
    """verl's meaning of ppo_clip + rollout_is: the clipped ratio is the weight; the weights are metrics only."""
    lp, rollout, adv, mask = _inputs()
    plain, plain_metrics = compute_bypass_loss(lp, rollout, adv, mask)
    loss, metrics = compute_bypass_loss(lp, rollout, adv, mask, rollout_is="token", rollout_is_threshold=1.05)
    assert torch.equal(loss, plain) and "rollout_is_weight_sum" not in plain_metrics
    want = sum(min(math.exp(a - b), 1.05) for a, b, m in zip(lp.flatten().tolist(), rollout.flatten().tolist(),
                                                               mask.flatten().tolist()) if m)
    assert metrics["rollout_is_weight_sum"].item() == pytest.approx(want, abs=1e-12)
    assert metrics["pg_clipfrac_sum"].item() == plain_metrics["pg_clipfrac_sum"].item()


def test_bad_loss_types_are_refused() -> None:
    lp, rollout, adv, mask = _inputs()
    with pytest.raises(ValueError, match=r"loss_type='pg'.*legal values: \['ppo_clip', 'reinforce'\]"):
        compute_bypass_loss(lp, rollout, adv, mask, loss_type="pg")


def test_rows_of_batch_packs_rows_left() -> None:
    values, mask = rows_of_batch(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.tensor([0, 0, 2, 2, 2]))
    assert values.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]
    assert mask.tolist() == [[True, True, False], [True, True, True]]


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_aggregation_every_mode(loss_type: str, mode: str) -> None:
    lp, rollout, adv, mask = _inputs()
    kwargs = {"rollout_is": "sequence"} if loss_type == "reinforce" else {}
    loss, _ = compute_bypass_loss(lp, rollout, adv, mask, loss_type=loss_type, **kwargs)
    tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    total = aggregate_loss(loss, mask, LossScale(mode, tokens, seqs))
    (grad,) = torch.autograd.grad(total, lp, retain_graph=True)
    (token_grad,) = torch.autograd.grad(loss.sum(), lp)
    rows = [(float((loss[b].detach() * mask[b]).sum()), float(mask[b].sum())) for b in range(len(ROWS))]
    want = {"token-mean": sum(s for s, _ in rows) / tokens, "seq-mean-token-sum": sum(s for s, _ in rows) / seqs,
            "seq-mean-token-mean": sum(s / n for s, n in rows) / seqs,
            "seq-mean-token-sum-norm": sum(s for s, _ in rows) / (seqs * R)}[mode]
    assert total.item() == pytest.approx(want, abs=1e-12)
    for b in range(len(ROWS)):
        share = {"token-mean": 1 / tokens, "seq-mean-token-sum": 1 / seqs, "seq-mean-token-mean": 1 / (seqs * rows[b][1]),
                 "seq-mean-token-sum-norm": 1 / (seqs * R)}[mode]
        for t in range(R):
            assert grad[b, t].item() == pytest.approx(token_grad[b, t].item() * share if mask[b, t] else 0.0, abs=1e-12)


BASE = {"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.rollout.n": 2,
        "trainer.n_gpus_per_node": 1}
RC = "algorithm.rollout_correction."


def _cfg(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {**BASE, **overrides}.items():
        OmegaConf.update(cfg, key, val)
    return cfg


def _errors(**overrides) -> list[str]:
    errors: list[str] = []
    cfg = _cfg(**overrides)
    check_bypass_mode(cfg, errors)  # the config stage's check
    check_rollout_correction_names(cfg, errors)  # the preflight's (option names from the registry)
    return errors


def test_defaults_and_bypass_wiring() -> None:
    cfg = _cfg()
    assert cfg.algorithm.rollout_correction.bypass_mode is False and cfg.algorithm.rollout_correction.loss_type == "ppo_clip"
    assert actor_policy_loss(cfg)[0] == "vanilla" and not uses_rollout_logprobs(cfg) and _errors() == []
    cfg = _cfg(**{f"{RC}bypass_mode": True, f"{RC}loss_type": "reinforce", f"{RC}rollout_is": "sequence",
                  f"{RC}rollout_rs": "seq_mean_k1", f"{RC}rollout_rs_threshold": "0.999_1.001"})
    assert check_bypass_mode(cfg, errs := []) is None and errs == []
    assert uses_rollout_logprobs(cfg) and not rollout_correction_settings(cfg).enabled  # corrected in the loss
    name, kwargs = actor_policy_loss(cfg)
    assert name == "bypass_mode" and kwargs == {
        "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "loss_type": "reinforce",
        "rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
        "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}


@pytest.mark.parametrize("overrides,message", [
    ({f"{RC}loss_type": "pg"}, r"loss_type='pg' is not supported; legal values: \['ppo_clip', 'reinforce'\]"),
    ({f"{RC}loss_type": "reinforce"}, "no effect without algorithm.rollout_correction.bypass_mode=true"),
    ({"actor_rollout_ref.actor.policy_loss.loss_mode": "bypass_mode"}, "is chosen by algorithm.rollout_correction.bypass_mode"),
    ({f"{RC}bypass_mode": True, "actor_rollout_ref.actor.policy_loss.loss_mode": "cispo"},
     "loss_mode='cispo' would be ignored.*async_training.use_rollout_log_probs=true"),
    ({f"{RC}bypass_mode": True, "async_training.use_rollout_log_probs": True}, "already takes the rollout logprobs"),
    ({f"{RC}bypass_mode": True, f"{RC}loss_type": "reinforce", "actor_rollout_ref.actor.clip_ratio_high": 0.28},
     "clip_ratio_high=0.28 has no effect with algorithm.rollout_correction.loss_type='reinforce'"),
    ({f"{RC}bypass_mode": True, f"{RC}rollout_rs": "seq_mean_k1", f"{RC}rollout_rs_threshold": "2_1_0"}, "rollout_rs_threshold"),
])
def test_illegal_combinations_are_refused(overrides: dict, message: str) -> None:
    errors = _errors(**overrides)
    assert any(__import__("re").search(message, e) for e in errors), errors
