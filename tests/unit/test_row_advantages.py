"""Outcome advantages from per-row values equal the token-level computation, element for element.

For every estimator rlsp computes from per-row values (rlsp.step.row_advantages), the compact
path — the registered estimator on a one-position response axis, broadcast as value * response_mask
— is compared with the same estimator on the full token-level rows: token rewards on each row's last
policy token, masks with holes (multi-turn tool output) and rows without any response token.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlsp.algos.registry import compute_advantages
from rlsp.config.schema import RLSPConfig
from rlsp.controller.step_data import StepData, new_row_ids
from rlsp.data.batch import Batch, last_policy_token
from rlsp.step.estimator_inputs import advantage_inputs
from rlsp.step.row_advantages import ROW_LEVEL_ESTIMATORS, compute_row_advantages, row_level
from rlsp.workers.columns import expand_row_broadcasts


def _cfg(name: str):
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator = name
    if name == "gdpo":
        cfg.algorithm.gdpo_reward_keys = ["acc", "fmt"]
    return cfg


def _rows(seed: int, B: int = 12, R: int = 7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    lengths[3] = 0  # a row without response tokens
    mask = (torch.arange(R).expand(B, R) < lengths[:, None]).float()
    mask[1, 1] = 0.0  # holes: tool output inside a trajectory
    mask[5, 0] = 0.0
    scores = torch.randint(0, 3, (B,), generator=g).double() + torch.rand(B, generator=g, dtype=torch.float64)
    token_scores = torch.zeros(B, R)
    token_scores[torch.arange(B), last_policy_token(mask)] = scores.float()
    token_scores = token_scores * mask
    extras = [{"score": float(s), "acc": float(s > 1), "fmt": float(s % 1 > 0.5)} for s in scores]
    uids = [f"p{i // 4}" for i in range(B)]
    full = Batch.from_dict({"token_level_rewards": token_scores, "response_mask": mask,
                            "reward_baselines": torch.rand(B, generator=g)},
                           meta={"uid": uids, "reward_extra_info": extras, "data_source": ["t"] * B})
    return full, scores


@pytest.mark.parametrize("name", ROW_LEVEL_ESTIMATORS)
@pytest.mark.parametrize("seed", [0, 1])
def test_row_level_equals_token_level(name: str, seed: int) -> None:
    cfg = _cfg(name)
    full, scores = _rows(seed)
    adv_full, ret_full = compute_advantages(name, advantage_inputs(full, cfg))
    table = Batch.from_dict({"row_reward": scores.float(), "response_tokens": full["response_mask"].sum(-1),
                             "reward_baselines": full["reward_baselines"]},
                            meta={k: full.meta[k] for k in ("uid", "reward_extra_info", "data_source")})
    step = StepData(new_row_ids(len(table)), table)
    assert row_level(cfg, step)
    compute_row_advantages(step, cfg)
    sent = Batch.from_dict({"advantages@row": step.row_value("advantages"), "returns@row": step.row_value("returns"),
                            "response_mask": full["response_mask"]})
    expanded = expand_row_broadcasts(sent)
    torch.testing.assert_close(expanded["advantages"], adv_full, rtol=0, atol=0)
    torch.testing.assert_close(expanded["returns"], ret_full, rtol=0, atol=0)


def test_token_level_settings_take_the_token_path() -> None:
    full, scores = _rows(0)
    table = Batch.from_dict({"row_reward": scores.float(), "response_tokens": full["response_mask"].sum(-1)})
    step = StepData(new_row_ids(len(table)), table)
    for name in ("gae", "reinforce_plus_plus", "opo"):
        assert not row_level(_cfg(name), step)
    cfg = _cfg("grpo")
    cfg.algorithm.use_kl_in_reward = True
    assert not row_level(cfg, step)
