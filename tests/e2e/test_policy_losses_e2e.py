"""End to end through `python -m rlsp.main` on the tiny model (Ray workers, FSDP2 over gloo, the rollout engine rlsp picks: HF generate for this model):
a sequence-level policy loss in the real pipeline.

gspo, named with rlsp's old flat spelling (rewritten by rlsp.main onto policy_loss.loss_mode), its clip keys
passed to the loss by the actor role, with Ulysses sp=2 so rows are split over the two workers and the
sequence ratio comes from the loss context. Two mini-batches per step make the second update off-policy (old
logprobs from the separate pass), so the ratio is not trivially 1. The run trains 2 steps and must log finite
losses and verl's metrics.
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
SETTINGS = {
    "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4, "trainer.n_gpus_per_node": 2, "trainer.device": "cpu",
    "trainer.total_training_steps": 2, "trainer.test_freq": -1, "trainer.val_before_train": False,
    "trainer.save_final_model": False, "trainer.plot": False,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
    "actor_rollout_ref.actor.policy_loss": "gspo",  # the flat spelling
    "actor_rollout_ref.actor.clip_ratio_low": 3e-4, "actor_rollout_ref.actor.clip_ratio_high": 4e-4,
    "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
}


def test_gspo_under_ulysses_through_rlsp_main(tmp_path):
    cmd = [sys.executable, "-m", "rlsp.main", *(f"{k}={v}" for k, v in SETTINGS.items()),
           f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "loss_mode: gspo" in config
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "reward/mean"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r.get(key))
        assert 0.0 <= r["actor/pg_clipfrac"] <= 1.0 and r["actor/pg_clipfrac_lower"] == 0.0
