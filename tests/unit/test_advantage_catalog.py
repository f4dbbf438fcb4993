"""verl's group estimators opo, gpg, grpo_passk and the aliases grpo_vectorized / rloo_vectorized.

Each estimator is compared element by element with values worked out by hand from its formula, on
small fp64 batches: groups of different sizes with interleaved rows, ragged masks with a hole, token
rewards spread over several tokens and garbage (99) on masked-out positions. Tolerance: atol 1e-12,
rtol 0 (a few fp64 roundings). Also: the aliases equal grpo / rloo exactly, settings an estimator does
not read are refused, groups of the wrong shape are refused, rollout.n >= 2 for every group estimator,
and `python -m rlsp.check` accepts each new name on the default demo config.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import rlsp.algos  # noqa: F401  (fills the registries)
from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.gpg import compute_gpg_advantages
from rlsp.algos.grpo_passk import compute_grpo_passk_advantages
from rlsp.algos.opo import compute_opo_advantages
from rlsp.algos.registry import estimator_uses, get_adv_estimator, list_adv_estimators
from rlsp.check import run_checks
from rlsp.config.compose import compose_config
from rlsp.config.validate import GROUP_ESTIMATORS, validate_config

F64 = torch.float64
GARBAGE = 99.0
TOL = {"rtol": 0.0, "atol": 1e-12}
NEW_NAMES = ["gpg", "grpo_passk", "grpo_vectorized", "opo", "rloo_vectorized"]


def _batch(rows: list[list[float | None]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token rewards, None = masked out (reward GARBAGE there); equal widths."""
    mask = torch.tensor([[0.0 if r is None else 1.0 for r in row] for row in rows], dtype=F64)
    rewards = torch.tensor([[GARBAGE if r is None else r for r in row] for row in rows], dtype=F64)
    return rewards, mask


def _check(adv: torch.Tensor, ret: torch.Tensor, mask: torch.Tensor, per_row: list[float]) -> None:
    """adv equals per_row broadcast over masked-in tokens, +0.0 exactly elsewhere; returns = advantages."""
    expected = torch.tensor(per_row, dtype=F64)[:, None] * mask
    torch.testing.assert_close(adv, expected, **TOL)
    off = adv[mask == 0]
    assert torch.all(off == 0) and not torch.any(torch.signbit(off))
    assert torch.equal(ret, adv)


# Groups a (3 rows), b (2 rows), c (1 row), interleaved. Scores (sum over masked-in tokens) and
# lengths (masked-in tokens): a: 1 (4), 0 (1), 1 (2, with a hole); b: 0.5 (3), 2 (1); c: 5 (2).
GROUPED = [
    [0.0, 0.0, 0.0, 1.0],    # a
    [0.25, 0.25, 0.0, None],  # b
    [0.0, None, None, None],  # a
    [2.0, 3.0, None, None],   # c
    [0.0, None, 1.0, None],   # a (hole)
    [2.0, None, None, None],  # b
]
GROUPED_INDEX = ["a", "b", "a", "c", "a", "b"]


def test_opo_length_weighted_baseline_by_hand() -> None:
    rewards, mask = _batch(GROUPED)
    adv, ret = compute_opo_advantages(AdvantageInputs(rewards, mask, GROUPED_INDEX))
    # a: b* = (4*1 + 1*0 + 2*1) / 7 = 6/7.  b: b* = (3*0.5 + 1*2) / 4 = 7/8.  c alone: b* = 0.
    _check(adv, ret, mask, [1 - 6 / 7, 0.5 - 7 / 8, 0 - 6 / 7, 5.0, 1 - 6 / 7, 2 - 7 / 8])


def test_opo_group_without_response_tokens_gives_zeros_not_nan() -> None:
    rewards, mask = _batch([[None, None], [None, None], [1.0, None], [0.0, 0.0]])
    adv, _ = compute_opo_advantages(AdvantageInputs(rewards, mask, ["e", "e", "f", "f"]))
    # f: b* = (1*1 + 2*0) / 3 = 1/3; e has no tokens (0/0 avoided: baseline 0, nothing to fill).
    _check(adv, adv, mask, [0.0, 0.0, 1 - 1 / 3, -1 / 3])


def test_gpg_verl_alpha_by_hand() -> None:
    rewards, mask = _batch(GROUPED)
    adv, ret = compute_gpg_advantages(AdvantageInputs(rewards, mask, GROUPED_INDEX))
    # Scores [1, 0.5, 0, 5, 1, 2]: 6 rows, 5 non-zero -> alpha = 6/5. Means a 2/3, b 5/4, c (alone) 0.
    alpha = 6 / 5
    _check(adv, ret, mask, [alpha * (1 - 2 / 3), alpha * (0.5 - 5 / 4), alpha * (0 - 2 / 3), alpha * 5.0,
                            alpha * (1 - 2 / 3), alpha * (2 - 5 / 4)])


def test_gpg_alpha_counts_nonzero_scores_not_informative_groups() -> None:
    # a = [1, 1] carries no signal but its scores are non-zero: verl's alpha = 4/3 (the paper's
    # B / (B - M), M = 2 uninformative samples, would be 2).
    rewards, mask = _batch([[1.0], [1.0], [1.0], [0.0]])
    adv, _ = compute_gpg_advantages(AdvantageInputs(rewards, mask, ["a", "a", "b", "b"]))
    _check(adv, adv, mask, [0.0, 0.0, 4 / 3 * 0.5, 4 / 3 * -0.5])
    rewards, mask = _batch([[-1.0, None], [0.5, 0.5], [0.0, 0.0]])  # negative scores count as non-zero
    adv, _ = compute_gpg_advantages(AdvantageInputs(rewards, mask, ["a", "a", "a"]))
    _check(adv, adv, mask, [1.5 * -1.0, 1.5 * 1.0, 1.5 * 0.0])
    rewards, mask = _batch([[0.0], [0.0], [0.0]])  # no non-zero score: alpha = 3/1, advantages 0
    adv, _ = compute_gpg_advantages(AdvantageInputs(rewards, mask, ["a", "a", "b"]))
    _check(adv, adv, mask, [0.0, 0.0, 0.0])


# Groups a (4 rows; tie for the best: 0.9, 0.9), b (3 rows; tie for second: 0.25, 0.25), d (2 rows).
PASSK = [
    [0.1, 0.1, 0.0],    # a 0.2
    [1.0, None, None],  # b 1    <- best of b
    [0.0, 1.0, None],   # d 1
    [0.9, 0.0, None],   # a 0.9
    [0.25, 0.0, 0.0],   # b 0.25
    [0.5, None, 0.0],   # a 0.5 (hole)
    [1.0, 1.0, 1.0],    # d 3    <- best of d
    [0.9, None, None],  # a 0.9
    [0.0, 0.25, None],  # b 0.25
]
PASSK_INDEX = ["a", "b", "d", "a", "b", "a", "d", "a", "b"]


def test_grpo_passk_without_std_by_hand() -> None:
    rewards, mask = _batch(PASSK)
    adv, ret = compute_grpo_passk_advantages(AdvantageInputs(rewards, mask, PASSK_INDEX, norm_adv_by_std=False))
    # a: 0.9 - 0.9 = 0 (tie for the best); b: 1 - 0.25; d: 3 - 1; every other row 0.
    _check(adv, ret, mask, [0.0, 0.75, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0])


def test_grpo_passk_with_std_by_hand() -> None:
    rewards, mask = _batch(PASSK)
    adv, ret = compute_grpo_passk_advantages(AdvantageInputs(rewards, mask, PASSK_INDEX, eps=0.0))
    # b: unbiased std of [1, .25, .25] = sqrt(.375 / 2) = sqrt(3)/4 -> 0.75 / (sqrt(3)/4) = sqrt(3).
    # d: std of [1, 3] = sqrt(2) -> 2 / sqrt(2) = sqrt(2).
    _check(adv, ret, mask, [0.0, math.sqrt(3), 0.0, 0.0, 0.0, 0.0, math.sqrt(2), 0.0, 0.0])
    adv_eps, _ = compute_grpo_passk_advantages(AdvantageInputs(rewards, mask, PASSK_INDEX))  # default eps = 1e-6
    std_b, std_d = statistics.stdev([1.0, 0.25, 0.25]), statistics.stdev([1.0, 3.0])
    _check(adv_eps, adv_eps, mask, [0.0, 0.75 / (std_b + 1e-6), 0.0, 0.0, 0.0, 0.0, 2 / (std_d + 1e-6), 0.0, 0.0])


def test_grpo_passk_all_equal_group_is_zero_and_singleton_refused() -> None:
    rewards, mask = _batch([[1.0], [1.0], [0.0], [1.0]])
    adv, _ = compute_grpo_passk_advantages(AdvantageInputs(rewards, mask, ["a", "a", "b", "b"]))
    # a: all equal -> 0 / (0 + eps) = 0.  b: 1 - 0, std sqrt(1/2).
    _check(adv, adv, mask, [0.0, 0.0, 0.0, 1 / (math.sqrt(0.5) + 1e-6)])
    with pytest.raises(ValueError, match=r"at least 2 samples per group .*1 group\(s\) have 1: \['solo'\]"):
        compute_grpo_passk_advantages(AdvantageInputs(rewards, mask, ["a", "a", "solo", "a"]))


@pytest.mark.parametrize("name", ["opo", "gpg", "grpo_passk"])
def test_one_group_id_per_row(name: str) -> None:
    rewards, mask = _batch([[1.0], [0.0], [1.0]])
    with pytest.raises(ValueError, match="one group id per row"):
        get_adv_estimator(name)(AdvantageInputs(rewards, mask, ["a", "a"]))


@pytest.mark.parametrize(("alias", "target", "settings"), [
    ("grpo_vectorized", "grpo", {}),
    ("grpo_vectorized", "grpo", {"norm_adv_by_std": False}),
    ("rloo_vectorized", "rloo", {}),
])
def test_aliases_equal_their_targets_exactly(alias: str, target: str, settings: dict) -> None:
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(10, 6, generator=gen, dtype=F64)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 1, 3, 5, 2, 6, 4, 1, 3, 6])[:, None]).to(F64)
    mask[0, 2] = mask[5, 3] = 0.0
    index = ["p0", "p1", "p2", "p0", "p1", "p2", "p0", "p2", "p3", "p3"]
    adv_a, ret_a = get_adv_estimator(alias)(AdvantageInputs(rewards, mask, index, **settings))
    adv_t, ret_t = get_adv_estimator(target)(AdvantageInputs(rewards, mask, index, **settings))
    assert torch.equal(adv_a, adv_t) and torch.equal(ret_a, ret_t)
    assert get_adv_estimator(alias).__wrapped__ is get_adv_estimator(target)
    assert estimator_uses(alias) == estimator_uses(target)


def test_registry_and_declared_settings() -> None:
    assert set(NEW_NAMES) <= set(list_adv_estimators())
    assert set(GROUP_ESTIMATORS) <= set(list_adv_estimators())
    assert estimator_uses("opo") == estimator_uses("rloo_vectorized") == ()
    assert estimator_uses("gpg") == ("reduce",)  # its alpha counts rows over every shard (rlsp.workers.step_stage)
    assert estimator_uses("grpo_passk") == estimator_uses("grpo_vectorized") == ("norm_adv_by_std",)


@pytest.mark.parametrize(("name", "setting"), [
    ("opo", {"gamma": 0.9}),
    ("opo", {"norm_adv_by_std": False}),
    ("gpg", {"norm_adv_by_std": False}),
    ("gpg", {"lam": 0.5}),
    ("grpo_passk", {"lam": 0.5}),
    ("grpo_passk", {"values_BR": torch.zeros(2, 1, dtype=F64)}),
    ("grpo_vectorized", {"gamma": 0.9}),
    ("rloo_vectorized", {"norm_adv_by_std": False}),
])
def test_unused_settings_are_refused(name: str, setting: dict) -> None:
    rewards, mask = _batch([[1.0], [0.0]])
    (key,) = setting
    with pytest.raises(ValueError, match=f"advantage estimator {name!r} does not use {key}"):
        get_adv_estimator(name)(AdvantageInputs(rewards, mask, ["a", "a"], **setting))


@pytest.mark.parametrize("name", ["grpo_passk", "rloo_vectorized"])  # the others take n=1 as verl does
def test_group_estimators_need_two_samples_per_prompt(name: str) -> None:
    cfg = compose_config(overrides=[f"algorithm.adv_estimator={name}", "actor_rollout_ref.rollout.n=1"])
    with pytest.raises(ValueError, match=rf"adv_estimator='{name}' compares samples of one prompt: "
                                         r"actor_rollout_ref.rollout.n=1 must be >= 2"):
        validate_config(cfg)


def test_non_group_estimator_and_n2_pass_the_rule() -> None:
    for overrides in (["algorithm.adv_estimator=reinforce_plus_plus", "actor_rollout_ref.rollout.n=1"],
                      ["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=2"]):
        validate_config(compose_config(overrides=overrides))


@pytest.fixture()
def check_args(tmp_path) -> list[str]:
    return ["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
            f"trainer.default_local_dir={tmp_path / 'run'}"]


@pytest.mark.parametrize("name", NEW_NAMES)
def test_rlsp_check_accepts_the_new_estimators(name: str, check_args: list[str]) -> None:
    report = run_checks([*check_args, f"algorithm.adv_estimator={name}"])
    assert report.problems == []


def test_rlsp_check_names_a_setting_the_estimator_ignores(check_args: list[str]) -> None:
    report = run_checks([*check_args, "algorithm.adv_estimator=opo", "algorithm.norm_adv_by_std_in_grpo=false"])
    assert any("algorithm.norm_adv_by_std_in_grpo=False has no effect with algorithm.adv_estimator='opo'" in p
               for p in report.problems), report.problems


@pytest.mark.parametrize("name,extra", [
    ("remax", []),
    ("gdpo", ["+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]", "+algorithm.gdpo_reward_weights=[1.0,0.5]"]),
    ("optimal_token_baseline", ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"]),
    ("tir_optimal_token_baseline", ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"]),
])
def test_rlsp_check_accepts_the_input_needing_estimators_with_verl_spellings(name: str, extra: list[str],
                                                                            check_args: list[str]) -> None:
    assert run_checks([*check_args, f"algorithm.adv_estimator={name}", *extra]).problems == []
    if extra:  # without what they need they are refused, naming the key
        problems = run_checks([*check_args, f"algorithm.adv_estimator={name}"]).problems
        key = "gdpo_reward_keys" if name == "gdpo" else "calculate_sum_pi_squared=true"
        assert len(problems) == 1 and key in problems[0], problems
