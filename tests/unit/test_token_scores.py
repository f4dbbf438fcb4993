"""A step's token scores from per-row parts (rlsp.rewards.token_scores): the driver's lazily built column
(rlsp.step.reward.derive_shaped_scores) equals its former in-place steps — the row's reward on its last
policy token, dapo's overlong shaping (`OverlongShaping.apply`), the tool step rewards added — bit for bit, on
rows with holes (tool output) and a row without policy tokens; and a shaped step leaves the per-row outcome
path (rlsp.step.row_advantages) for the workers' stage. (The stage's side: tests/distributed/test_stage_estimators.py.)"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from rlsp.config.schema import RLSPConfig
from rlsp.controller.step_data import from_batch
from rlsp.data.batch import Batch
from rlsp.rewards.overlong import OverlongShaping
from rlsp.rewards.scoring import place_scores
from rlsp.rewards.token_scores import shaped_token_scores
from rlsp.step.reward import derive_shaped_scores, overlong_penalties
from rlsp.step.row_advantages import row_level

B, P, R = 6, 2, 8
SHAPING = OverlongShaping(max_resp_len=R, buffer_len=4, penalty_factor=1.5)


def _rows() -> Batch:
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([8, 3, 7, 0, 6, 8])
    attention_R = (torch.arange(R)[None, :] < lengths[:, None]).float()
    mask = attention_R.clone()
    mask[2, 2:4] = 0  # tool output inside a trajectory: counted in its length, not a policy token
    return Batch.from_dict({"response_mask": mask, "attention_mask": torch.cat([torch.ones(B, P), attention_R], 1),
                            "input_ids": torch.zeros(B, P + R, dtype=torch.long),
                            "row_reward": torch.rand(B, generator=gen) * 2, "response_length": lengths,
                            "response_tokens": mask.sum(-1),
                            "step_rewards": (torch.rand(B, R, generator=gen) > 0.7).float() * 0.3 * mask})


def _former(rows: Batch) -> torch.Tensor:
    """The driver's former steps, in place on a Batch."""
    old = Batch.from_dict({k: rows[k] for k in ("response_mask", "attention_mask", "input_ids")})
    old.set("token_level_scores", place_scores(rows["row_reward"].tolist(), rows["response_mask"]))
    SHAPING.apply(old)
    return old["token_level_scores"] + rows["step_rewards"] * rows["response_mask"]


def test_the_lazy_shaped_scores_equal_the_former_in_place_steps():
    rows = _rows()
    step = from_batch(rows)
    step.set("overlong_reward", overlong_penalties(SHAPING, step))
    derive_shaped_scores(step, step_rewards=True)
    assert "token_level_scores" not in step.table  # not built until read
    got = step["token_level_scores"]
    assert torch.equal(got, _former(rows))
    assert (got[rows["response_mask"] == 0] == 0).all() and (got[3] == 0).all()
    assert torch.equal(step["overlong_reward"], SHAPING.apply(Batch.from_dict(
        {"response_mask": rows["response_mask"], "attention_mask": rows["attention_mask"],
         "token_level_scores": torch.zeros(B, R)})))


def test_reward_model_scores_take_the_rows_reward_place():
    rows = _rows()
    rm_BR = place_scores((rows["row_reward"] + 1).tolist(), rows["response_mask"])
    got = shaped_token_scores(rows["response_mask"], rows["row_reward"], rm_BR, step_rewards_BR=rows["step_rewards"])
    assert torch.equal(got, rm_BR + rows["step_rewards"] * rows["response_mask"])


def test_a_shaped_step_is_not_an_outcome_step():
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.algorithm.adv_estimator = "grpo"
    step = from_batch(_rows())
    step.meta["uid"] = [f"p{i // 2}" for i in range(B)]
    assert row_level(cfg, step)
    step.set("overlong_reward", overlong_penalties(SHAPING, step))
    assert not row_level(cfg, step)  # token-level: the workers add the penalty (rlsp.step.stage_advantages)
