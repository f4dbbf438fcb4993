"""GDPO (arXiv:2601.05242): reward components normalised within their group one by one, weighted, summed,
then whitened over the batch's response tokens.

The estimator is compared element by element (fp64, atol 1e-12, rtol 0) with values worked out by hand:
the per-group statistics in closed form, the final whitening recomputed with Python's `statistics`
module over the token list. Also: the reward function's dict output reaches the estimator (Scorer ->
reward_extra_info -> reward_components), a missing or non-numeric component stops the step naming the
row, and start-up refuses gdpo without keys, with mismatched weights, or with token-reward changes it
would not see.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from omegaconf import OmegaConf

import rlsp.algos  # noqa: F401  (fills the registries)
from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.gdpo import compute_gdpo_advantages
from rlsp.algos.grpo import compute_grpo_advantages
from rlsp.algos.registry import estimator_uses, get_adv_estimator
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import GROUP_ESTIMATORS
from rlsp.data.batch import Batch
from rlsp.models.tokenizer import build_char_tokenizer
from rlsp.rewards.scoring import Scorer
from rlsp.step.estimator_inputs import advantage_inputs, estimator_errors, reward_components

F64 = torch.float64
TOL = {"rtol": 0.0, "atol": 1e-12}
R3, R2 = math.sqrt(3.0), math.sqrt(2.0)

# Groups a (rows 0, 1, 4), b (rows 2, 3), c (row 5, alone); response lengths 2, 1, 3, 2, 1, 2 of 3.
INDEX = ["a", "a", "b", "b", "a", "c"]
LENGTHS = [2, 1, 3, 2, 1, 2]
ACC = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
FMT = [0.0, 1.0, 0.0, 1.0, 1.0, 2.0]


def _mask() -> torch.Tensor:
    return torch.tensor([[1.0 if t < n else 0.0 for t in range(3)] for n in LENGTHS], dtype=F64)


def _whiten_by_hand(per_row: list[float]) -> list[list[float]]:
    """Each row's value on its tokens, whitened with the mean and sample variance of the token list."""
    tokens = [v for v, n in zip(per_row, LENGTHS) for _ in range(n)]
    mean, var = statistics.fmean(tokens), statistics.variance(tokens)
    return [[(v - mean) / math.sqrt(var + 1e-8) if t < n else 0.0 for t in range(3)] for v, n in zip(per_row, LENGTHS)]


def test_gdpo_by_hand_with_weights() -> None:
    comps = {"acc": torch.tensor(ACC, dtype=F64), "fmt": torch.tensor(FMT, dtype=F64)}
    rewards = torch.full((6, 3), 99.0, dtype=F64)  # not read: the components are the reward
    adv, ret = compute_gdpo_advantages(AdvantageInputs(rewards, _mask(), INDEX, eps=0.0, reward_components=comps,
                                                       gdpo_reward_weights=(1.0, 0.5)))
    # acc: a = [1, 0, 1] -> mean 2/3, std 1/sqrt3 -> [1/3, -2/3, 1/3] * sqrt3; b = [0, 1] -> -+1/sqrt2; c alone: 0.5.
    # fmt: a = [0, 1, 1] -> [-2/3, 1/3, 1/3] * sqrt3; b = [0, 1] -> -+1/sqrt2; c alone: 2.
    summed = [R3 / 3 - R3 / 3, -2 * R3 / 3 + R3 / 6, -1.5 / R2, 1.5 / R2, R3 / 3 + R3 / 6, 0.5 + 1.0]
    expected = torch.tensor(_whiten_by_hand(summed), dtype=F64)
    torch.testing.assert_close(adv, expected, **TOL)
    assert torch.equal(ret, adv) and torch.all(adv[_mask() == 0] == 0)


def test_gdpo_separates_rows_whose_reward_sums_tie() -> None:
    # (acc, fmt) = (1, 0) and (0, 1): the sums tie, so GRPO on the sum gives both rows 0; so does GDPO here,
    # since the two components' normalised values cancel: acc -> +-1/sqrt2, fmt -> -+1/sqrt2.
    comps = {"acc": torch.tensor([1.0, 0.0], dtype=F64), "fmt": torch.tensor([0.0, 1.0], dtype=F64)}
    mask = torch.ones(2, 1, dtype=F64)
    adv, _ = compute_gdpo_advantages(AdvantageInputs(torch.zeros(2, 1, dtype=F64), mask, ["a", "a"], eps=0.0,
                                                     reward_components=comps))
    torch.testing.assert_close(adv, torch.zeros(2, 1, dtype=F64), **TOL)
    # Weighted 1 : 0.5 they no longer cancel: S = +-(1 - 0.5) / sqrt2.
    adv, _ = compute_gdpo_advantages(AdvantageInputs(torch.zeros(2, 1, dtype=F64), mask, ["a", "a"], eps=0.0,
                                                     reward_components=comps, gdpo_reward_weights=(1.0, 0.5)))
    s = 0.5 / R2  # whitened over 2 tokens: mean 0, sample variance 2 s^2
    torch.testing.assert_close(adv, torch.tensor([[s], [-s]], dtype=F64) / math.sqrt(2 * s * s + 1e-8), **TOL)


def test_a_tied_component_adds_nothing_thanks_to_eps() -> None:
    comps = {"acc": torch.tensor([1.0, 0.0], dtype=F64), "fmt": torch.tensor([3.0, 3.0], dtype=F64)}
    adv, _ = compute_gdpo_advantages(AdvantageInputs(torch.zeros(2, 1, dtype=F64), torch.ones(2, 1, dtype=F64),
                                                     ["a", "a"], reward_components=comps))  # eps = 1e-6
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # acc's normalised value; fmt's is 0 / (0 + eps) = 0
    torch.testing.assert_close(adv, torch.tensor([[a], [-a]], dtype=F64) / math.sqrt(2 * a * a + 1e-8), **TOL)


def test_one_component_is_grpo_whitened_over_tokens() -> None:
    comps = {"score": torch.tensor(ACC, dtype=F64)}
    rewards = torch.zeros(6, 3, dtype=F64)
    rewards[torch.arange(6), torch.tensor(LENGTHS) - 1] = torch.tensor(ACC, dtype=F64)
    gdpo, _ = get_adv_estimator("gdpo")(AdvantageInputs(rewards, _mask(), INDEX, reward_components=comps))
    grpo, _ = compute_grpo_advantages(AdvantageInputs(rewards, _mask(), INDEX))
    grpo_rows = [float(grpo[i, 0]) for i in range(6)]
    torch.testing.assert_close(gdpo, torch.tensor(_whiten_by_hand(grpo_rows), dtype=F64), **TOL)


def test_gdpo_refuses_bad_inputs() -> None:
    mask = torch.ones(2, 2, dtype=F64)
    with pytest.raises(ValueError, match="'gdpo' needs reward_components"):
        compute_gdpo_advantages(AdvantageInputs(mask, mask, ["a", "a"]))
    comps = {"acc": torch.zeros(2, dtype=F64), "fmt": torch.zeros(2, dtype=F64)}
    with pytest.raises(ValueError, match=r"gdpo_reward_weights has 1 entries for 2 reward components \['acc', 'fmt'\]"):
        compute_gdpo_advantages(AdvantageInputs(mask, mask, ["a", "a"], reward_components=comps,
                                                gdpo_reward_weights=(1.0,)))
    with pytest.raises(ValueError, match=r"reward component 'x' has shape \(3,\); need one value per row, \[2\]"):
        compute_gdpo_advantages(AdvantageInputs(mask, mask, ["a", "a"], reward_components={"x": torch.zeros(3)}))
    with pytest.raises(ValueError, match="'gdpo' does not use norm_adv_by_std"):  # verl's gdpo always divides by std
        compute_gdpo_advantages(AdvantageInputs(mask, mask, ["a", "a"], norm_adv_by_std=False, reward_components=comps))
    with pytest.raises(ValueError, match="'grpo' does not use reward_components"):
        compute_grpo_advantages(AdvantageInputs(mask, mask, ["a", "a"], reward_components=comps))
    assert estimator_uses("gdpo") == ("gdpo_reward_weights", "reward_components", "reduce") and "gdpo" in GROUP_ESTIMATORS


def _scored_batch(tmp_path, body: str) -> Batch:
    path = tmp_path / "score.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" + body)
    tok = build_char_tokenizer()
    ids = torch.tensor([tok.encode("12", add_special_tokens=False)] * 4)
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                             "response_mask": torch.ones(4, ids.shape[1])},
                            meta={"data_source": ["src"] * 4, "ground_truth": ["3"] * 4, "uid": ["a", "a", "b", "b"],
                                  "extra_info": [{"i": i} for i in range(4)], "index": list(range(4))})
    scores = Scorer(tok, str(path)).score_rows(batch)
    batch.set("token_level_rewards", batch["token_level_scores"])
    assert scores.tolist() == [float(i % 2) for i in range(4)]
    return batch


def test_a_dict_reward_reaches_the_estimator(tmp_path) -> None:
    batch = _scored_batch(tmp_path, "    i = extra_info['i']\n"
                                    "    return {'score': float(i % 2), 'acc': float(i % 2), 'fmt': float(i == 3), "
                                    "'note': 'x'}\n")
    assert batch.meta["reward_extra_info"][3] == {"score": 1.0, "acc": 1.0, "fmt": 1.0, "note": "x"}
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator, cfg.algorithm.gdpo_reward_keys = "gdpo", ["acc", "fmt"]
    inputs = advantage_inputs(batch, cfg)
    torch.testing.assert_close(inputs.reward_components["acc"], torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=F64))
    torch.testing.assert_close(inputs.reward_components["fmt"], torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=F64))
    assert inputs.index == ["a", "a", "b", "b"] and inputs.gdpo_reward_weights is None
    with pytest.raises(RuntimeError, match=r"reward component 'note' of row 0 is 'x': need a finite number"):
        reward_components(batch, ["note"])
    with pytest.raises(RuntimeError, match=r"gdpo_reward_keys names 'len', but the reward function's output for row 0 "
                                           r"\(data_source='src'\) has \['acc', 'fmt', 'note', 'score'\]"):
        reward_components(batch, ["acc", "len"])


def test_a_plain_number_reward_has_no_components(tmp_path) -> None:
    batch = _scored_batch(tmp_path, "    return float(extra_info['i'] % 2)\n")
    assert batch.meta["reward_extra_info"] == [{}] * 4
    with pytest.raises(RuntimeError, match=r"names 'acc'.* has \[\]: return a dict with 'score' and every key"):
        reward_components(batch, ["acc"])


def test_start_up_checks_of_gdpo() -> None:
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator = "gdpo"
    (error,) = estimator_errors(cfg)
    assert "algorithm.adv_estimator='gdpo' needs algorithm.gdpo_reward_keys" in error
    cfg.algorithm.gdpo_reward_keys, cfg.algorithm.gdpo_reward_weights = ["acc", "fmt"], [1.0]
    (error,) = estimator_errors(cfg)
    assert "algorithm.gdpo_reward_weights=[1.0] has 1 entries for 2 algorithm.gdpo_reward_keys ['acc', 'fmt']" in error
    cfg.algorithm.gdpo_reward_weights = [1.0, 0.5]
    assert estimator_errors(cfg) == []
    cfg.algorithm.use_kl_in_reward, cfg.reward_model.enable = True, True
    errors = estimator_errors(cfg)
    assert len(errors) == 2 and "algorithm.use_kl_in_reward=true adds the KL penalty" in errors[0]
    assert "reward_model.enable=true adds the reward model's score" in errors[1]
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.gdpo_reward_keys, cfg.algorithm.gdpo_reward_weights = ["acc"], [2.0]
    errors = estimator_errors(cfg)  # grpo reads neither
    assert "algorithm.gdpo_reward_weights=[2.0] has no effect with algorithm.adv_estimator='grpo'" in errors[0]
    assert "algorithm.gdpo_reward_keys=['acc'] has no effect with algorithm.adv_estimator='grpo'" in errors[1]
