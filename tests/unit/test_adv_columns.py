"""One builder of the estimator's input record (rlsp.algos.adv_columns.build_advantage_inputs) for the driver
(rlsp.step.estimator_inputs.advantage_inputs) and the policy workers' step stage (rlsp.workers.step_stage):
on the same rows every registered estimator gives the same advantages and returns bit for bit on both routes,
and a missing input column fails on both with the same message, naming the column and what produces it."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlsp.algos.adv_columns import INPUT_COLUMNS
from rlsp.algos.registry import compute_advantages, list_adv_estimators
from rlsp.config.schema import RLSPConfig
from rlsp.data.batch import Batch
from rlsp.rewards.scoring import place_scores
from rlsp.step.estimator_inputs import advantage_inputs, config_settings, set_stage_components
from rlsp.step.off_policy import reads_is_weights
from rlsp.workers.step_stage import STAGE_READS, StageRequest, run_step_stage

B, R = 6, 4
WEIGHTED = "optimal_token_baseline+is"  # the optimal token baseline with the rollout-correction weights


def _cfg(name: str):
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator = name.removesuffix("+is")
    if name == WEIGHTED:
        cfg.algorithm.rollout_correction.rollout_is = "token"
    if name == "gdpo":
        cfg.algorithm.gdpo_reward_keys = ["acc", "fmt"]
    return cfg


def _rows() -> Batch:
    gen = torch.Generator().manual_seed(11)
    mask = (torch.rand(B, R, generator=gen) > 0.3).float()
    mask[:, 0], mask[4] = 1, 0  # a row without response tokens
    acc, fmt = torch.randint(0, 2, (B,), generator=gen).tolist(), torch.rand(B, generator=gen).tolist()
    scores = [a + f for a, f in zip(acc, fmt)]
    old = -torch.rand(B, R, generator=gen) * 2
    return Batch.from_dict(
        {"response_mask": mask, "row_reward": torch.tensor(scores), "token_level_scores": place_scores(scores, mask),
         "values": torch.randn(B, R, generator=gen), "reward_baselines": torch.rand(B, generator=gen),
         "old_logprobs": old, "sum_pi_squared": old.exp() ** 2 + 0.1 * torch.rand(B, R, generator=gen),
         "rollout_is_weights": 0.5 + torch.rand(B, R, generator=gen)},
        meta={"uid": [f"p{i % 3}" for i in range(B)], "data_source": ["src"] * B,
              "reward_extra_info": [{"score": a + f, "acc": a, "fmt": f} for a, f in zip(acc, fmt)]})


def _driver(cfg, rows: Batch) -> Batch:
    """The driver's computation (rlsp.step.estimator_inputs.advantage_inputs, then the estimator) on `rows`."""
    driver = rows.copy()
    driver.set("token_level_rewards", driver["token_level_scores"])
    adv, ret = compute_advantages(cfg.algorithm.adv_estimator, advantage_inputs(driver, cfg))
    driver.set("advantages", adv)
    driver.set("returns", ret)
    return driver


def _stage(cfg, rows: Batch) -> Batch:
    """The step stage's computation on `rows`, sent as the driver sends them (the scores as per-row rewards)."""
    components = set_stage_components(rows, cfg)
    sent = Batch.from_dict({k: rows[k] for k in STAGE_READS if k in rows.tensors.keys() and k != "token_level_scores"},
                           meta={"uid": rows.meta["uid"]})
    request = StageRequest(cfg.algorithm.adv_estimator, config_settings(cfg), components=components,
                           rollout_is_weights=reads_is_weights(cfg))
    return run_step_stage(sent, request, None)


@pytest.mark.parametrize("name", [*list_adv_estimators(), WEIGHTED])
def test_driver_and_stage_give_every_estimator_the_same_record(name: str) -> None:
    driver, stage = _driver(_cfg(name), _rows()), _stage(_cfg(name), _rows())
    assert torch.equal(stage["advantages"], driver["advantages"]), name
    assert torch.equal(stage["returns"], driver["returns"]), name
    assert torch.count_nonzero(driver["advantages"]) > 0


def test_the_weights_are_read_only_when_asked() -> None:
    cfg, unweighted = _cfg("optimal_token_baseline"), _rows()
    del unweighted.tensors["rollout_is_weights"]
    plain = _driver(cfg, _rows())  # the column is there, not asked for
    assert torch.equal(plain["advantages"], _driver(cfg, unweighted)["advantages"])
    assert not torch.equal(_driver(_cfg(WEIGHTED), _rows())["advantages"], plain["advantages"])


@pytest.mark.parametrize("name, field", [("gae", "values_BR"), ("remax", "reward_baselines_B"),
                                         ("optimal_token_baseline", "old_logprobs_BR"),
                                         ("tir_optimal_token_baseline", "sum_pi_squared_BR"),
                                         (WEIGHTED, "rollout_is_weights_BR")])
def test_a_missing_column_fails_alike_on_both_routes(name: str, field: str) -> None:
    cfg, (column, producer) = _cfg(name), INPUT_COLUMNS[field]
    rows = _rows()
    del rows.tensors[column]
    expected = f"advantage estimator {cfg.algorithm.adv_estimator!r} needs {column!r} from {producer}; the rows have ["
    for route in (_driver, _stage):
        with pytest.raises(RuntimeError) as failed:
            route(cfg, rows)
        assert str(failed.value).startswith(expected), route.__name__
