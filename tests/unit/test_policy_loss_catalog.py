"""Policy losses beyond "vanilla": cispo and gpg against hand-computed values, gradients and metrics (gspo,
geo_mean, sapo: tests/unit/test_sequence_losses.py); the registry and POLICY_LOSS_KEYS in step with every
loss's signature; keys a loss does not read refused by config validation; the nested policy_loss block and
the old spellings through rlsp.check."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from omegaconf import OmegaConf

from rlsp.algos.cispo import compute_cispo_loss
from rlsp.algos.gpg_loss import compute_gpg_loss
from rlsp.algos.registry import get_policy_loss, list_policy_losses
from rlsp.check import run_checks
from rlsp.config.compose import parse_command_line
from rlsp.config.schema import RLSPConfig
from rlsp.config.schema_policy_loss import rewrite_policy_loss_override, rewrite_policy_loss_overrides
from rlsp.config.validate_policy_loss import (
    POLICY_LOSS_KEY_DEFAULTS,
    POLICY_LOSS_KEYS,
    check_policy_loss_keys,
    policy_loss_kwargs,
    policy_loss_users,
)

F64 = torch.float64
# Tokens: (ratio, advantage, old logprob, mask). Ratios inside and on both sides of [0.8, 1.2].
TOKENS = [(1.1, 1.0, -1.0, 1), (1.5, 2.0, -0.5, 1), (0.5, -1.0, -2.0, 1), (0.95, -0.5, -1.5, 1),
          (3.0, 1.5, -3.0, 0), (0.7, 0.3, -0.2, 1), (1.0, -2.0, -0.7, 0)]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ratio = torch.tensor([t[0] for t in TOKENS], dtype=F64)
    old = torch.tensor([t[2] for t in TOKENS], dtype=F64)
    logprobs = (old + torch.log(ratio)).requires_grad_(True)
    adv = torch.tensor([t[1] for t in TOKENS], dtype=F64)
    mask = torch.tensor([t[3] for t in TOKENS], dtype=F64)
    return logprobs, old, adv, mask


def test_registry_lists_every_loss_and_validation_knows_their_keys() -> None:
    assert {"cispo", "geo_mean", "gpg", "gspo", "sapo", "vanilla"} <= set(list_policy_losses())
    assert get_policy_loss("cispo") is compute_cispo_loss and get_policy_loss("gpg") is compute_gpg_loss
    assert sorted(POLICY_LOSS_KEYS) == list_policy_losses()


@pytest.mark.parametrize("name", sorted(POLICY_LOSS_KEYS))
def test_each_loss_declares_exactly_the_keys_it_is_passed(name: str) -> None:
    """Keyword-only parameters = the last components of its POLICY_LOSS_KEYS + the loss context (bypass_mode
    also takes the algorithm.rollout_correction settings, which rlsp/config/validate_bypass.py passes)."""
    params = inspect.signature(get_policy_loss(name)).parameters.values()
    keywords = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    declared = {key.rpartition(".")[2] for key in POLICY_LOSS_KEYS[name]} | {"context"}
    assert declared <= keywords
    if name != "bypass_mode":
        assert keywords == declared
    for key in POLICY_LOSS_KEYS[name]:
        assert key in POLICY_LOSS_KEY_DEFAULTS, key


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.1, 0.3)])
def test_cispo_values_gradients_and_metrics_by_hand(low: float, high: float) -> None:
    logprobs, old, adv, mask = _inputs()
    loss, metrics = compute_cispo_loss(logprobs, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    n_on, clipped, kl = 0, 0, 0.0
    for i, (ratio, a, old_lp, m) in enumerate(TOKENS):
        lp = old_lp + math.log(ratio)
        r_hat = min(max(ratio, 1.0 - low), 1.0 + high)
        assert loss[i].item() == (pytest.approx(-r_hat * a * lp, abs=1e-12) if m else 0.0)
        assert grad[i].item() == (pytest.approx(-r_hat * a, abs=1e-12) if m else 0.0)  # sg: no d r_hat / d lp
        if m:
            n_on += 1
            clipped += r_hat != pytest.approx(ratio, abs=1e-12)
            kl += -math.log(ratio)
    assert metrics["num_tokens"].item() == n_on
    assert metrics["pg_clipfrac_sum"].item() == clipped and clipped > 0
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / n_on, abs=1e-12)
    assert metrics["pg_clipfrac_lower_sum"].item() == 0.0 and metrics["pg_clipfrac_lower"].item() == 0.0
    assert metrics["ppo_kl_sum"].item() == pytest.approx(kl, abs=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(kl / n_on, abs=1e-12)
    assert all(not v.requires_grad for v in metrics.values())


def test_cispo_keeps_gradient_where_ppo_clip_would_zero_it() -> None:
    old = torch.zeros(2, dtype=F64)
    logprobs = torch.log(torch.tensor([2.0, 0.25], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, _ = compute_cispo_loss(logprobs, old, adv, torch.ones(2, dtype=F64))
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    torch.testing.assert_close(grad, torch.tensor([-1.2, 0.8], dtype=F64), rtol=0, atol=1e-12)


def test_gpg_values_gradients_and_metrics_by_hand() -> None:
    logprobs, old, adv, mask = _inputs()
    loss, metrics = compute_gpg_loss(logprobs, old + 5.0, adv, mask)  # old logprobs are not read
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    for i, (ratio, a, old_lp, m) in enumerate(TOKENS):
        lp = old_lp + math.log(ratio)
        assert loss[i].item() == (pytest.approx(-a * lp, abs=1e-12) if m else 0.0)
        assert grad[i].item() == (pytest.approx(-a, abs=1e-12) if m else 0.0)
    assert metrics == {"num_tokens": mask.sum()}


def test_masked_tokens_are_exact_zeros_even_with_non_finite_inputs() -> None:
    logprobs, old, adv, mask = _inputs()
    adv = adv.masked_fill(mask == 0, float("nan"))
    for fn in (compute_cispo_loss, compute_gpg_loss):
        loss, _ = fn(logprobs, old, adv, mask)
        assert torch.all(loss[mask == 0] == 0.0) and torch.isfinite(loss).all()


def test_losses_accept_exactly_the_keywords_the_actor_passes() -> None:
    logprobs, old, adv, mask = (x.unsqueeze(0) for x in _inputs())  # one row: batch-level losses need rows
    actor = _actor()
    for name in list_policy_losses():
        actor.policy_loss.loss_mode = name
        get_policy_loss(name)(logprobs, old, adv, mask, **policy_loss_kwargs(actor))


def _actor(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, value in overrides.items():
        OmegaConf.update(cfg.actor_rollout_ref.actor, key, value)
    return cfg.actor_rollout_ref.actor


@pytest.mark.parametrize("loss,overrides,bad", [
    ("gpg", {"clip_ratio": 0.3}, ["clip_ratio"]),
    ("gpg", {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28}, ["clip_ratio_low", "clip_ratio_high"]),
    ("gpg", {"clip_ratio_c": 10.0}, []),  # verl's losses that do not read clip_ratio_c ignore it: accepted, noted
    ("cispo", {"clip_ratio_c": 10.0}, []),
    ("cispo", {"clip_ratio_low": 0.1, "clip_ratio_high": 5.0}, []),
    ("gpg", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}, []),  # what they resolve to anyway
    ("vanilla", {"clip_ratio": 0.3, "clip_ratio_c": 10.0}, []),
    ("gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, []),
    ("gspo", {"clip_ratio_c": 10.0}, []),  # verl's GSPO example sets it; verl's GSPO ignores it too
    ("geo_mean", {"clip_ratio": 0.4, "policy_loss.tau_pos": 2.0}, ["policy_loss.tau_pos"]),
    ("sapo", {"policy_loss.tau_pos": 2.0, "policy_loss.tau_neg": 3.0, "clip_ratio": 0.3}, ["clip_ratio"]),
    ("vanilla", {"policy_loss.clip_cov_ratio": 0.1, "policy_loss.ppo_kl_coef": 1.0},
     ["policy_loss.clip_cov_ratio", "policy_loss.ppo_kl_coef"]),
])
def test_validation_refuses_unused_keys(loss: str, overrides: dict, bad: list[str]) -> None:
    errors: list[str] = []
    check_policy_loss_keys(_actor(**{"policy_loss.loss_mode": loss}, **overrides), errors)
    assert len(errors) == len(bad)
    for error, key in zip(errors, sorted(bad, key=list(overrides).index), strict=True):
        assert error.startswith(f"actor_rollout_ref.actor.{key}=") and f"policy_loss.loss_mode={loss!r}" in error


@pytest.fixture()
def check_args(tmp_path) -> list[str]:
    return ["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
            f"trainer.default_local_dir={tmp_path / 'run'}"]


def test_validation_refuses_a_temperature_that_is_not_positive() -> None:
    errors: list[str] = []
    check_policy_loss_keys(_actor(**{"policy_loss.loss_mode": "sapo", "policy_loss.tau_neg": 0.0}), errors)
    assert errors == ["actor_rollout_ref.actor.policy_loss.tau_neg=0.0 must be > 0 (sapo's gate temperature)"]


@pytest.mark.parametrize("args", [
    ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_low=3e-4",
     "actor_rollout_ref.actor.clip_ratio_high=4e-4", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
    ["actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean", "actor_rollout_ref.actor.clip_ratio_low=0.4",
     "actor_rollout_ref.actor.clip_ratio_high=0.4"],
    ["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.policy_loss.tau_pos=1.0",
     "actor_rollout_ref.actor.policy_loss.tau_neg=1.05"],
    ["actor_rollout_ref.actor.policy_loss=sapo", "actor_rollout_ref.actor.tau_neg=2.0"],  # rlsp's flat, verl's tau
    ["actor_rollout_ref.actor.policy_loss=cispo"],
    ["actor_rollout_ref.actor.policy_loss=gpg"],
])
def test_rlsp_check_accepts_the_losses_with_their_keys(args: list[str], check_args: list[str]) -> None:
    report = run_checks([*check_args, *args])
    assert report.problems == [], report.render()


def test_rlsp_check_names_a_key_of_another_loss(check_args: list[str]) -> None:
    report = run_checks([*check_args, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                         "actor_rollout_ref.actor.tau_pos=2.0"])
    assert report.problems == [
        "actor_rollout_ref.actor.policy_loss.tau_pos=2.0 has no effect with actor_rollout_ref.actor.policy_loss."
        "loss_mode='gspo'; leave it at 1.0 or pick a policy loss that uses it: ['sapo']"], report.problems


def test_rlsp_check_names_a_clip_key_the_loss_ignores(check_args: list[str]) -> None:
    report = run_checks([*check_args, "actor_rollout_ref.actor.policy_loss=gpg",
                         "actor_rollout_ref.actor.clip_ratio_high=0.28"])
    users = policy_loss_users("clip_ratio_high")
    assert {"cispo", "geo_mean", "gspo", "vanilla"} <= set(users) and not {"gpg", "sapo"} & set(users)
    assert report.problems == [
        "actor_rollout_ref.actor.clip_ratio_high=0.28 has no effect with actor_rollout_ref.actor.policy_loss.loss_mode="
        f"'gpg'; leave it at None or pick a policy loss that uses it: {users}"], report.problems


@pytest.mark.parametrize("given,rewritten", [
    ("actor_rollout_ref.actor.policy_loss=cispo", "actor_rollout_ref.actor.policy_loss.loss_mode=cispo"),
    ("++actor_rollout_ref.actor.policy_loss=gspo", "++actor_rollout_ref.actor.policy_loss.loss_mode=gspo"),
    ("actor_rollout_ref.actor.tau_pos=0.5", "actor_rollout_ref.actor.policy_loss.tau_pos=0.5"),
    ("actor_rollout_ref.actor.tau_neg=2", "actor_rollout_ref.actor.policy_loss.tau_neg=2"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.policy_loss.loss_mode=sapo"),
    ("~actor_rollout_ref.actor.policy_loss", "~actor_rollout_ref.actor.policy_loss"),  # a deletion stays one
    ("actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio=0.3"),
    ("critic.policy_loss=cispo", "critic.policy_loss=cispo"),
])
def test_old_spellings_are_rewritten_onto_the_nested_block(given: str, rewritten: str) -> None:
    assert rewrite_policy_loss_override(given) == rewritten
    assert rewrite_policy_loss_overrides([given, "trainer.seed=1"]) == [rewritten, "trainer.seed=1"]
    assert parse_command_line(["--config-name", "verl", given]).overrides == [rewritten]


def test_rlsp_check_notes_verls_aggregation_of_the_sequence_losses(check_args: list[str]) -> None:
    report = run_checks([*check_args, "actor_rollout_ref.actor.policy_loss.loss_mode=sapo"])
    assert report.problems == [], report.render()
    assert ("actor_rollout_ref.actor.policy_loss.loss_mode: verl's names; gspo, geo_mean and sapo: verl aggregates "
            "them with seq-mean-token-mean whatever actor.loss_agg_mode says") in report.render()
