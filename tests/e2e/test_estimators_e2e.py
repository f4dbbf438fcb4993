"""End to end through `python -m rlsp.main` on the tiny model (Ray workers, FSDP2 over gloo, the rollout engine rlsp picks: HF generate for this model):
the estimators that need more than the rewards get it from the real pipeline.

* remax: a greedy pass per step, its reward logged as the baseline, its time as timing/gen_baseline_s;
* gdpo: a custom reward function returning a dict of components, normalised separately;
* optimal_token_baseline: the actor's old-logprob pass returns sum pi^2 (with Ulysses sp=2), and the rollout
  correction's importance weights, computed once on the workers before the advantages.
Each run trains 2 steps and must write finite metrics.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = {
    "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4, "trainer.n_gpus_per_node": 2, "trainer.device": "cpu",
    "trainer.total_training_steps": 2, "trainer.test_freq": -1, "trainer.val_before_train": False,
    "trainer.save_final_model": False, "trainer.plot": False,
}
# The rollout correction with the optimal token baselines: its importance weights scale the baseline's w (rho^2).
CORRECTION = ("algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_batch_normalize=true",
              "algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=2.0")
GDPO_REWARD = '''
from rlsp.rewards.registry import get_reward_fn


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    accuracy = float(get_reward_fn(data_source)(data_source, solution_str, ground_truth, extra_info) >= 1.0)
    short = float(len(solution_str.strip()) <= 4)
    return {"score": accuracy + short, "accuracy_reward": accuracy, "format_reward": short}
'''


def _run(tmp_path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "rlsp.main", *(f"{k}={v}" for k, v in SMALL.items()),
           f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path.parent / 'cache'}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        for key in ("reward/mean", "actor/pg_loss", "timing/adv_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r.get(key))
    return lines


def test_remax_generates_and_scores_a_greedy_baseline(tmp_path):
    for r in _run(tmp_path, "algorithm.adv_estimator=remax"):
        assert r["timing/gen_baseline_s"] > 0.0 and r["timing/reward_baseline_s"] >= 0.0
        assert 0.0 <= r["reward/baseline_mean"] <= 1.0 and r["reward/baseline_response_length_mean"] >= 1.0


def test_gdpo_with_reward_components_from_a_custom_function(tmp_path):
    score = tmp_path / "score.py"
    score.write_text(GDPO_REWARD)
    lines = _run(tmp_path, "algorithm.adv_estimator=gdpo", f"reward.custom_function_path={score}",
                 "+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]", "algorithm.gdpo_reward_weights=[1.0,0.5]")
    assert all(0.0 <= r["reward/mean"] <= 2.0 for r in lines)


def test_optimal_token_baseline_with_sum_pi_squared_under_ulysses(tmp_path):
    lines = _run(tmp_path, "algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
                 "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", *CORRECTION)
    for r in lines:  # the correction ran on the workers before the advantages, which read its weights
        assert r["rollout_corr/rollout_is_batch_norm_factor"] > 0 and 0 <= r["rollout_corr/rollout_rs_masked_fraction"] <= 1
