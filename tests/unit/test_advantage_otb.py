"""Optimal token baseline (verl's optimal_token_baseline / tir_optimal_token_baseline) against hand values.

Every element is compared (fp64, atol 1e-12, rtol 0) with numbers worked out from the formula
w_t = 1 - 2 pi_t + sum pi^2, W_t = cumulative w over a row's tokens, B_t = sum G W / (sum W + 1e-8) per
group, A = G - B: by response column (optimal_token_baseline), by rank among each row's policy tokens
with the zero tail (tir_...), with importance weights, one-row groups, an empty row and garbage (99)
on masked-out positions. The trainer side: the actor's old logprobs and sum of pi^2 and the rollout IS
weights reach the estimator from a real Batch, and start-up refuses what cannot work.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

import rlsp.algos  # noqa: F401  (fills the registries)
from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.otb import compute_otb_advantages, compute_tir_otb_advantages
from rlsp.algos.registry import compute_advantages, estimator_uses, get_adv_estimator
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import GROUP_ESTIMATORS
from rlsp.data.batch import Batch
from rlsp.step.estimator_inputs import advantage_inputs, estimator_errors
from rlsp.step.off_policy import rollout_correction_settings
from rlsp.workers.stage_correction import run_correction

F64 = torch.float64
G = 99.0
TOL = {"rtol": 0.0, "atol": 1e-12}
EPS = 1e-8


def _inputs(rewards, mask, pi, spp, index, **kw) -> AdvantageInputs:
    lp = torch.tensor(pi, dtype=F64).clamp_min(1e-300).log()  # pi = 0 stands for masked-out garbage
    return AdvantageInputs(torch.tensor(rewards, dtype=F64), torch.tensor(mask, dtype=F64), index,
                           old_logprobs_BR=lp, sum_pi_squared_BR=torch.tensor(spp, dtype=F64), **kw)


# Group a: rows 0, 1; group b: row 2 alone.
REWARDS = [[0.0, 0.0, 1.0], [0.0, 2.0, G], [3.0, G, G]]
MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
PI = [[0.5, 0.25, 1.0], [0.5, 0.5, 0.0], [0.2, 0.0, 0.0]]
SPP = [[0.5, 0.375, 1.0], [0.25, 0.5, G], [0.3, G, G]]
INDEX = ["a", "a", "b"]


def test_otb_by_hand() -> None:
    adv, ret = compute_otb_advantages(_inputs(REWARDS, MASK, PI, SPP, INDEX))
    # w row 0 = [1 - 1 + .5, 1 - .5 + .375, 1 - 2 + 1] = [.5, .875, 0] -> W = [.5, 1.375, 1.375]; G = [1, 1, 1]
    # w row 1 = [1 - 1 + .25, 1 - 1 + .5] = [.25, .5] -> W = [.25, .75]; G = [2, 2]
    b = [(1 * .5 + 2 * .25) / (.75 + EPS), (1 * 1.375 + 2 * .75) / (2.125 + EPS), (1 * 1.375) / (1.375 + EPS)]
    expected = [[1 - b[0], 1 - b[1], 1 - b[2]], [2 - b[0], 2 - b[1], 0.0], [3.0, 0.0, 0.0]]  # b alone: A = G
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), **TOL)
    torch.testing.assert_close(ret, torch.tensor([[1.0] * 3, [2.0, 2.0, 0.0], [3.0, 0.0, 0.0]], dtype=F64), **TOL)


def test_otb_importance_weights_scale_w_by_rho_squared() -> None:
    rho = torch.tensor([[2.0, 1.0, 0.5], [1.0, 3.0, G], [1.0, G, G]], dtype=F64)
    adv, _ = get_adv_estimator("optimal_token_baseline")(_inputs(REWARDS, MASK, PI, SPP, INDEX,
                                                                 rollout_is_weights_BR=rho))
    # row 0: w = [.5 * 4, .875, 0 * .25] -> W = [2, 2.875, 2.875]; row 1: w = [.25, .5 * 9] -> W = [.25, 4.75]
    b = [(2 + 2 * .25) / (2.25 + EPS), (2.875 + 2 * 4.75) / (7.625 + EPS), 2.875 / (2.875 + EPS)]
    expected = [[1 - b[0], 1 - b[1], 1 - b[2]], [2 - b[0], 2 - b[1], 0.0], [3.0, 0.0, 0.0]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), **TOL)


# Multi-turn rows of group a: row 0 has a tool token at column 1 (masked out), row 1 is shorter, row 2 has no
# policy token; group b's row 3 is alone.
TIR_REWARDS = [[0.0, G, 0.0, 1.0], [0.0, 0.5, G, G], [G, G, G, G], [0.0, 2.0, G, G]]
TIR_MASK = [[1, 0, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
TIR_PI = [[0.5, 0.0, 0.5, 0.5], [0.5, 0.5, 0.0, 0.0], [0.0] * 4, [0.5, 0.5, 0.0, 0.0]]
TIR_SPP = [[0.5, G, 0.5, 0.5], [0.5, 0.5, G, G], [G] * 4, [0.5, 0.5, G, G]]  # w = 0.5 on every policy token
TIR_INDEX = ["a", "a", "a", "b"]


def test_tir_otb_by_hand_lines_up_policy_tokens_and_zeroes_the_tail() -> None:
    adv, ret = compute_tir_otb_advantages(_inputs(TIR_REWARDS, TIR_MASK, TIR_PI, TIR_SPP, TIR_INDEX))
    # Ranks: row 0 tokens at columns 0, 2, 3 -> k = 0, 1, 2 with G = [1, 1, 1], W = [.5, 1, 1.5];
    # row 1 columns 0, 1 -> k = 0, 1 with G = [.5, .5], W = [.5, 1]. Row 2 has no token: out of the group.
    b0, b1 = (1 * .5 + .5 * .5) / (1 + EPS), (1 * 1 + .5 * 1) / (2 + EPS)
    # Row 0 is strictly the longest (3 > 2): its baseline is 0 from k = 2 on. Row 3 alone: A = G.
    expected = [[1 - b0, 0.0, 1 - b1, 1.0], [.5 - b0, .5 - b1, 0.0, 0.0], [0.0] * 4, [2.0, 2.0, 0.0, 0.0]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), **TOL)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0, 1.0], [.5, .5, 0, 0], [0.0] * 4, [2.0, 2.0, 0, 0]],
                                                 dtype=F64), **TOL)


def test_column_variant_on_the_same_rows_lines_up_columns() -> None:
    adv, _ = compute_otb_advantages(_inputs(TIR_REWARDS, TIR_MASK, TIR_PI, TIR_SPP, TIR_INDEX))
    # Column 0: rows 0, 1 (W .5, .5); column 1: row 1 only (row 0's tool token is out); columns 2, 3: row 0
    # alone (W 1, 1.5). The empty row 2 is in the group (3 rows) but adds nothing; no zero tail.
    b = [(1 * .5 + .5 * .5) / (1 + EPS), (.5 * 1) / (1 + EPS), 1 * 1 / (1 + EPS), 1 * 1.5 / (1.5 + EPS)]
    expected = [[1 - b[0], 0.0, 1 - b[2], 1 - b[3]], [.5 - b[0], .5 - b[1], 0.0, 0.0], [0.0] * 4,
                [2.0, 2.0, 0.0, 0.0]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), **TOL)


def test_tied_longest_rows_keep_their_tail_baseline() -> None:
    rewards, mask = [[0.0, 1.0], [1.0, 0.0]], [[1, 1], [1, 1]]
    pi, spp = [[0.5, 0.5], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]]
    adv, _ = compute_tir_otb_advantages(_inputs(rewards, mask, pi, spp, ["a", "a"]))
    b = [(1 * .5 + 1 * .5) / (1 + EPS), (1 * 1 + 0 * 1) / (2 + EPS)]  # G row 0 = [1, 1], row 1 = [1, 0]
    torch.testing.assert_close(adv, torch.tensor([[1 - b[0], 1 - b[1]], [1 - b[0], 0 - b[1]]], dtype=F64), **TOL)
    assert not math.isclose(b[1], 0.0)


def test_otb_needs_the_actor_outputs_and_refuses_other_settings() -> None:
    rewards, mask = torch.zeros(2, 2, dtype=F64), torch.ones(2, 2, dtype=F64)
    with pytest.raises(ValueError, match="needs old_logprobs_BR .*calculate_sum_pi_squared=true"):
        compute_otb_advantages(AdvantageInputs(rewards, mask, ["a", "a"], sum_pi_squared_BR=mask))
    with pytest.raises(ValueError, match=r"sum_pi_squared_BR shape \(2, 3\) != response mask shape \(2, 2\)"):
        compute_otb_advantages(AdvantageInputs(rewards, mask, ["a", "a"], old_logprobs_BR=mask,
                                               sum_pi_squared_BR=torch.ones(2, 3)))
    with pytest.raises(ValueError, match="'tir_optimal_token_baseline' does not use gamma"):
        compute_tir_otb_advantages(AdvantageInputs(rewards, mask, ["a", "a"], gamma=0.5, old_logprobs_BR=mask,
                                                   sum_pi_squared_BR=mask))
    with pytest.raises(ValueError, match="'grpo' does not use sum_pi_squared_BR"):
        get_adv_estimator("grpo")(AdvantageInputs(rewards, mask, ["a", "a"], sum_pi_squared_BR=mask))
    assert estimator_uses("optimal_token_baseline") == ("old_logprobs_BR", "sum_pi_squared_BR", "rollout_is_weights_BR")
    assert {"optimal_token_baseline", "tir_optimal_token_baseline"} <= set(GROUP_ESTIMATORS)


def _trainer_batch() -> Batch:
    mask = torch.tensor(MASK, dtype=torch.float32)
    old = torch.tensor(PI, dtype=torch.float32).clamp_min(1e-30).log() * mask
    rows = {"token_level_rewards": torch.tensor(REWARDS, dtype=torch.float32) * mask, "response_mask": mask,
            "old_logprobs": old, "sum_pi_squared": torch.tensor(SPP, dtype=torch.float32) * mask,
            "rollout_logprobs": old - torch.log(torch.tensor([[1.5, 3.0, 1.0], [1.0, 0.5, 1.0], [2.0, 1.0, 1.0]])) * mask}
    return Batch.from_dict(rows, meta={"uid": INDEX})


def _otb_cfg(**updates):
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator = "optimal_token_baseline"
    cfg.actor_rollout_ref.actor.calculate_sum_pi_squared = True
    for key, value in updates.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def test_trainer_hands_the_actor_outputs_and_the_is_weights_to_the_estimator() -> None:
    batch = _trainer_batch()
    inputs = advantage_inputs(batch, _otb_cfg())
    assert inputs.old_logprobs_BR is batch["old_logprobs"] and inputs.sum_pi_squared_BR is batch["sum_pi_squared"]
    assert inputs.rollout_is_weights_BR is None and inputs.values_BR is None
    adv, _ = compute_advantages("optimal_token_baseline", inputs)
    ref, _ = compute_otb_advantages(_inputs(REWARDS, MASK, PI, SPP, INDEX))
    torch.testing.assert_close(adv.double(), ref, rtol=0.0, atol=1e-6)  # fp32 batch vs the fp64 hand example
    # Token-level truncated IS (threshold 2): rho = pi_old / pi_rollout = [1.5, 3 -> 2, 1], [1, .5], [2], the
    # column the correction wrote on the workers before the advantages (rlsp.workers.stage_correction).
    weighted_cfg = _otb_cfg(**{"algorithm.rollout_correction.rollout_is": "token"})
    with pytest.raises(RuntimeError, match="needs 'rollout_is_weights' from the rollout correction .*, run before the advantages"):
        advantage_inputs(batch, weighted_cfg)
    batch.update(run_correction(batch, rollout_correction_settings(weighted_cfg), None))
    rho = advantage_inputs(batch, weighted_cfg).rollout_is_weights_BR
    expected = torch.tensor([[1.5, 2.0, 1.0], [1.0, 0.5, 0.0], [2.0, 0.0, 0.0]])
    torch.testing.assert_close(rho * batch["response_mask"], expected, rtol=0.0, atol=1e-6)
    del batch.tensors["sum_pi_squared"]
    with pytest.raises(RuntimeError, match="'optimal_token_baseline' needs 'sum_pi_squared' from the actor's logprob "
                                           "pass with actor_rollout_ref.actor.calculate_sum_pi_squared=true"):
        advantage_inputs(batch, _otb_cfg())


def test_start_up_checks_of_the_optimal_token_baselines() -> None:
    assert estimator_errors(_otb_cfg()) == []
    (error,) = estimator_errors(_otb_cfg(**{"actor_rollout_ref.actor.calculate_sum_pi_squared": False}))
    assert "'optimal_token_baseline' needs actor_rollout_ref.actor.calculate_sum_pi_squared=true" in error
    (error,) = estimator_errors(_otb_cfg(**{"algorithm.rollout_correction.bypass_mode": True}))
    assert "needs the actor's old-logprob pass" in error and "bypass_mode" in error
    (error,) = estimator_errors(_otb_cfg(**{"algorithm.adv_estimator": "grpo"}))
    assert error.startswith("actor_rollout_ref.actor.calculate_sum_pi_squared=true has no effect with "
                            "algorithm.adv_estimator='grpo'")
    assert "['optimal_token_baseline', 'tir_optimal_token_baseline']" in error
