"""End to end through `python -m rlsp.main` on the tiny model: the KL penalty in the reward computed on the
policy workers (rlsp.workers.step_stage) feeding an estimator that runs on the driver (GRPO reads the
workers' token rewards), with the adaptive controller on the driver. (GAE with KL in the reward:
tests/e2e/test_ppo_e2e.py; the stage's numbers against the driver's formulas: tests/distributed/test_step_stage.py.)
"""

from __future__ import annotations

import math

import pytest
from test_estimators_e2e import _run

pytestmark = pytest.mark.e2e


def test_grpo_with_kl_in_the_reward_from_the_workers(tmp_path):
    lines = _run(tmp_path, "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=true",
                 "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.horizon=10",
                 "actor_rollout_ref.actor.use_kl_loss=false")
    for r in lines:
        assert math.isfinite(r["actor/reward_kl_penalty"])  # k1 (the default estimate) may be negative
    coeffs = [r["actor/reward_kl_penalty_coeff"] for r in lines]
    assert coeffs[0] == 0.05 and coeffs[1] != coeffs[0]  # the driver's controller got the workers' KL
