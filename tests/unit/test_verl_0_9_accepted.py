"""verl 0.9 settings rlsp accepts because they change nothing it computes (tests/unit/test_verl_commands_0_9.py
pins the commands that set them): rollout.n=1 with a group estimator, clip_ratio_c with a loss that does not read
it, rollout.max_model_len >= prompt + response, the teacher pool's sizes and tensor-parallel degrees, and
use_prefix_grouper.

A group of one sample: each estimator's advantages are compared, every element, with verl's formula for such a
group written out per row here (verl v0.9.0 core_algos: grpo/gpg mean 0 and std 1, rloo/opo/otb baseline 0), in
float64 within `roundoff_rtol` of the sums involved. The others: the value is honoured (what the run uses) and
the note is printed.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from tolerances import assert_tensor_close, roundoff_rtol

import rlsp.algos  # noqa: F401  (fills the registries)
from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.registry import get_adv_estimator
from rlsp.config.compose import compose_config, drop_not_set
from rlsp.config.describe import group_of_one_note
from rlsp.config.validate import validate_config
from rlsp.config.validate_core import SINGLETON_ADVANTAGE, SINGLETON_REFUSED
from rlsp.config.validate_keys import schema_keys
from rlsp.config.validate_policy_loss import POLICY_LOSS_KEYS, policy_loss_kwargs
from rlsp.config.verl_compat import verl_note, verl_status
from rlsp.config.verl_keys import answer

F64 = torch.float64
EPS = 1e-6  # AdvantageInputs' and verl's default epsilon
# Three rows of 4 response tokens, 0.0 where masked out; token rewards on the kept tokens.
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
REWARDS = [[0.0, 0.5, 1.0, 9.0], [0.0, -2.0, 9.0, 9.0], [0.25, 0.0, 0.0, 0.5]]  # 9.0: masked out, never read


def _inputs(index: list[str], **kw) -> AdvantageInputs:
    mask = torch.tensor(MASK, dtype=F64)
    return AdvantageInputs(torch.tensor(REWARDS, dtype=F64), mask, index, **kw)


def _scores() -> list[float]:
    return [sum(r for r, m in zip(row, keep) if m) for row, keep in zip(REWARDS, MASK)]


def _broadcast(per_row: list[float]) -> torch.Tensor:
    return torch.tensor([[a * m for m in keep] for a, keep in zip(per_row, MASK)], dtype=F64)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert_tensor_close(got, ref, roundoff_rtol(reduction=len(MASK[0]) * len(MASK), stages=3, dtype=F64))


def _verl_grpo(scores: list[float], index: list[str], norm: bool = True) -> list[float]:
    """verl's compute_grpo_outcome_advantage per row: a group of one has mean 0 and std 1 (torch.std, n-1)."""
    out = []
    for s, g in zip(scores, index):
        group = [x for x, h in zip(scores, index) if h == g]
        mean, std = (0.0, 1.0) if len(group) == 1 else (statistics.mean(group), statistics.stdev(group))
        out.append((s - mean) / (std + EPS) if norm else s - mean)
    return out


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized"])
@pytest.mark.parametrize("index", [["a", "b", "c"], ["a", "b", "b"]])  # n=1; one singleton beside a pair
def test_grpo_group_of_one_is_verl_formula(name: str, index: list[str]) -> None:
    adv, ret = get_adv_estimator(name)(_inputs(index))
    ref = _broadcast(_verl_grpo(_scores(), index))
    _close(adv, ref)
    _close(ret, ref)
    if name == "grpo":
        adv, _ = get_adv_estimator(name)(_inputs(index, norm_adv_by_std=False))
        _close(adv, _broadcast(_verl_grpo(_scores(), index, norm=False)))


@pytest.mark.parametrize("name", ["rloo", "opo"])
def test_baseline_zero_for_a_group_of_one(name: str) -> None:
    adv, ret = get_adv_estimator(name)(_inputs(["a", "b", "c"]))
    _close(adv, _broadcast(_scores()))  # verl: id2mean / id2bsl = 0 for a group of one: the raw score
    _close(ret, _broadcast(_scores()))


def test_gpg_group_of_one_is_alpha_times_score() -> None:
    scores = _scores()
    alpha = len(scores) / max(sum(s != 0 for s in scores), 1)  # verl: bsz / count_nonzero(scores)
    adv, _ = get_adv_estimator("gpg")(_inputs(["a", "b", "c"]))
    _close(adv, _broadcast([alpha * s for s in scores]))


def test_gdpo_group_of_one_whitens_the_raw_components() -> None:
    comps = {"acc": [1.0, 0.0, 1.0], "fmt": [0.5, 0.25, 0.0]}
    weights = (1.0, 2.0)
    summed = [sum(w * comps[k][i] / (1.0 + EPS) for w, k in zip(weights, comps)) for i in range(3)]
    tokens = [s for s, keep in zip(summed, MASK) for m in keep if m]  # verl's masked_whiten over response tokens
    mean, var = statistics.mean(tokens), statistics.variance(tokens)
    ref = _broadcast([(s - mean) / (var + 1e-8) ** 0.5 for s in summed])
    adv, _ = get_adv_estimator("gdpo")(_inputs(["a", "b", "c"], gdpo_reward_weights=weights, reward_components={
        k: torch.tensor(v, dtype=F64) for k, v in comps.items()}))
    _close(adv, ref)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_otb_group_of_one_is_the_return(name: str) -> None:
    mask = torch.tensor(MASK, dtype=F64)
    logp = torch.full_like(mask, -0.5)
    adv, ret = get_adv_estimator(name)(_inputs(["a", "b", "c"], old_logprobs_BR=logp,
                                               sum_pi_squared_BR=torch.full_like(mask, 0.3)))
    togo = [[sum(r * k for r, k in zip(row[t:], keep[t:])) * keep[t] for t in range(len(row))]
            for row, keep in zip(REWARDS, MASK)]
    _close(ret, torch.tensor(togo, dtype=F64))
    _close(adv, torch.tensor(togo, dtype=F64))  # verl: N == 1, no baseline: advantage = return


def _cfg(*overrides: str):
    return compose_config(overrides=["trainer.device=cpu", *overrides])


@pytest.mark.parametrize("name", sorted(SINGLETON_ADVANTAGE))
def test_n1_accepted_with_a_note(name: str) -> None:
    cfg = _cfg(f"algorithm.adv_estimator={name}", "actor_rollout_ref.rollout.n=1")
    validate_config(cfg)
    note = group_of_one_note(cfg)
    assert note is not None and f"adv_estimator={name!r}" in note and "raw" in note
    assert group_of_one_note(_cfg(f"algorithm.adv_estimator={name}", "actor_rollout_ref.rollout.n=2")) is None
    assert group_of_one_note(_cfg("algorithm.adv_estimator=reinforce_plus_plus", "actor_rollout_ref.rollout.n=1")) is None


@pytest.mark.parametrize("name", sorted(SINGLETON_REFUSED))
def test_n1_still_refused_where_verl_differs(name: str) -> None:
    with pytest.raises(ValueError, match=rf"adv_estimator={name!r} compares samples of one prompt: "
                                         r"actor_rollout_ref.rollout.n=1 must be >= 2 \("):
        validate_config(_cfg(f"algorithm.adv_estimator={name}", "actor_rollout_ref.rollout.n=1"))


def test_clip_ratio_c_accepted_where_the_loss_ignores_it() -> None:
    for loss in ("gspo", "geo_mean", "cispo"):
        cfg = _cfg(f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}", "actor_rollout_ref.actor.clip_ratio_c=10.0")
        validate_config(cfg)
        assert "clip_ratio_c" not in policy_loss_kwargs(cfg.actor_rollout_ref.actor)  # as verl: the loss never sees it
    vanilla = _cfg("actor_rollout_ref.actor.clip_ratio_c=10.0")
    assert policy_loss_kwargs(vanilla.actor_rollout_ref.actor)["clip_ratio_c"] == 10.0  # honoured where read
    assert "clip_ratio_c" in POLICY_LOSS_KEYS["vanilla"]
    note = verl_note("actor_rollout_ref.actor.clip_ratio_c")
    assert note is not None and "gspo" in note and "ignore it" in note
    with pytest.raises(ValueError, match="clip_ratio_c=0.5 must be > 1"):  # the range holds whatever the loss
        validate_config(_cfg("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_c=0.5"))


def test_rollout_max_model_len_is_a_cap_that_must_not_bind() -> None:
    need = "data.max_prompt_length=16", "data.max_response_length=8"
    for ok in ("null", "24", "4096"):
        validate_config(_cfg(*need, f"actor_rollout_ref.rollout.max_model_len={ok}"))
    with pytest.raises(ValueError, match=r"rollout.max_model_len=23 is smaller than a whole sequence \(.* = 24\).*"
                                         r"legal values: null or an integer >= 24"):
        validate_config(_cfg(*need, "actor_rollout_ref.rollout.max_model_len=23"))
    assert verl_status("actor_rollout_ref.rollout.max_model_len", set(schema_keys())).startswith("accepted: verl's cap")


def _distill(*overrides: str, single: bool = True) -> list[str]:
    """The distillation problems of a config (one teacher, `teacher_model`, unless `single` is false)."""
    one = ["distillation.teacher_models.teacher_model.model_path=/teacher"] if single else []
    cfg = _cfg("distillation.enabled=true", "distillation.distillation_loss.use_policy_gradient=true", *one,
               *overrides)
    try:
        validate_config(cfg)
    except ValueError as exc:
        return [line for line in str(exc).splitlines() if "distillation" in line]
    return []


def test_teacher_pool_sizes_accepted_and_checked_as_verl_does() -> None:
    tp = "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size"
    assert _distill("distillation.n_gpus_per_node=4", "distillation.nnodes=1", f"{tp}=2") == []
    assert _distill("distillation.n_gpus_per_node=8", "distillation.nnodes=0", f"{tp}=8") == []  # no pool: nothing
    (bad,) = _distill("distillation.n_gpus_per_node=4", "distillation.nnodes=1", f"{tp}=3")
    assert f"{tp}=3 does not divide verl's teacher pool" in bad and "= 4)" in bad
    (neg,) = _distill("distillation.nnodes=-1")
    assert "distillation.nnodes=-1 must be >= 0" in neg
    two = [f"+distillation.teacher_models.{t}.{k}" for t in ("x", "y") for k in ("model_path=/t", f"key={t}")]
    rep = [f"+distillation.teacher_models.{t}.num_replicas=1" for t in ("x", "y")]
    assert _distill("distillation.n_gpus_per_node=2", "distillation.nnodes=1", *two, *rep, single=False) == []
    (bad,) = _distill("distillation.n_gpus_per_node=4", "distillation.nnodes=1", *two, *rep, single=False)
    assert "add up to 2, not verl's teacher pool" in bad
    for key in ("distillation.n_gpus_per_node", "distillation.nnodes", tp,
                "distillation.teacher_models.x.num_replicas"):
        note = verl_note(key)
        assert note is not None and "rlsp has no teacher pool" in note, key


def test_prefix_grouper_dropped_with_the_note() -> None:
    for value, words in (("True", "(n - 1) x prompt tokens more per group"), ("false", "verl's \"not set\"")):
        kept, notes = drop_not_set([f"actor_rollout_ref.actor.use_prefix_grouper={value}", "data.train_batch_size=8"])
        assert kept == ["data.train_batch_size=8"]  # dropped: rlsp computes the same either way
        assert len(notes) == 1 and notes[0].startswith(f"actor_rollout_ref.actor.use_prefix_grouper={value}: ")
        assert words in notes[0], notes
    status, text = answer("actor_rollout_ref.actor.use_prefix_grouper", set(schema_keys()))
    assert status == "rlsp" and text.startswith("True, False: verl's prefix grouper")
