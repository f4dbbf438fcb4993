"""DAPO end to end on the tiny model (Ray workers, FSDP2 over gloo, the rollout engine rlsp picks: HF generate for this model): dynamic sampling
(algorithm.filter_groups) with the dapo reward manager's overlong shaping.

The reward function scores 0 for every prompt whose answer is odd (those groups never differ: filtered)
and one bit of the response's hash otherwise (samples of one prompt mostly differ), so each step needs
extra generation batches:
* every step trains on exactly data.train_batch_size prompts x rollout.n samples, each group informative,
  out of generation rounds of data.gen_batch_size prompts;
* each row's token scores are its reward plus eq. 13's penalty of its length;
* the counts add up (kept + filtered = generated, kept - trimmed = train_batch_size) and the data position
  counts every batch consumed;
* on the asynchronous rollout pool (staleness_threshold 0) the extra units replacing filtered groups are
  generated with the current weights: the run completes with staleness 0 and the same counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_grpo_e2e import _cfg, ray_session  # noqa: F401  (the module's Ray session fixture)

from rlsp.data.batch import response_lengths
from rlsp.trainer.ray_trainer import RayTrainer

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REWARD = """import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2:
        return 0.0
    return float(zlib.crc32(solution_str.encode()) % 2)
"""
BUF = "reward.reward_kwargs.overlong_buffer_cfg."


def _dapo(tmp_path) -> dict:
    path = tmp_path / "parity_reward.py"
    path.write_text(REWARD)
    return {"reward.custom_function_path": str(path), "reward.reward_manager.name": "dapo", BUF + "enable": True,
            BUF + "len": 4, BUF + "penalty_factor": 0.5, BUF + "log": True, "algorithm.filter_groups.enable": True,
            "algorithm.filter_groups.metric": "acc", "algorithm.filter_groups.max_num_gen_batches": 20,
            "trainer.total_training_steps": 2}


class RecordingTrainer(RayTrainer):
    """The real trainer; it keeps what each step trained on."""

    def train_on(self, step, batch, t0, timing):
        self.read(batch, ["token_level_scores", "response_mask", "attention_mask"])  # the columns recorded below
        self.trained.append({"uid": list(batch.meta["uid"]), "score": list(batch.meta["row_score"]),
                             "tokens": batch["token_level_scores"].sum(-1).double(),
                             "lengths": response_lengths(batch)})
        return super().train_on(step, batch, t0, timing)


def _check_counts(metrics: dict, needed: int, per_batch: int, unit: float = 1.0) -> None:
    """Generation is counted in data batches of `per_batch` prompts; the async pool delivers units of `unit`
    batch each; a step trains on `needed` prompts."""
    gen = metrics["train/num_gen_batches"]
    assert gen / unit == int(gen / unit) and gen >= 1
    assert metrics["train/num_groups_kept"] + metrics["train/num_groups_filtered"] == gen * per_batch
    assert metrics["train/num_groups_kept"] - metrics["train/num_groups_trimmed"] == needed


def test_filtered_steps_train_on_exactly_train_batch_size_prompts(tmp_path, ray_session):  # noqa: F811
    # verl's DAPO setting: generation rounds of data.gen_batch_size = 8 prompts for 4 trained ones
    trainer = RecordingTrainer(*_cfg(tmp_path, **_dapo(tmp_path), **{"data.gen_batch_size": 8}))
    trainer.trained = []
    try:
        trainer.start_workers()
        steps = list(trainer.run_steps(2))
    finally:
        trainer.shutdown()
    assert [s for s, _ in steps] == [1, 2] and len(trainer.trained) == 2
    for (_, metrics), rows in zip(steps, trainer.trained):
        assert len(rows["uid"]) == 4 * 4 and len(set(rows["uid"])) == 4
        for uid in set(rows["uid"]):
            group = [s for u, s in zip(rows["uid"], rows["score"]) if u == uid]
            assert len(group) == 4 and len(set(group)) > 1  # informative: the scores differ
        # token scores = reward + penalty, penalty = -(L - (8 - 4)) / 4 * 0.5 above 4 tokens (eq. 13)
        expected = [s + min(0.0, -(n - 4) / 4 * 0.5) for s, n in zip(rows["score"], rows["lengths"])]
        torch.testing.assert_close(rows["tokens"], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
        _check_counts(metrics, 4, 8)
        assert metrics["reward/overlong_reward/mean"] <= 0.0 and 0.0 <= metrics["reward/overlong/ratio"] <= 1.0
        assert metrics["reward/errors"] == 0.0 and 0.0 <= metrics["reward/accuracy"] <= 1.0
    assert sum(m["train/num_groups_filtered"] for _, m in steps) > 0  # odd answers were filtered
    # The data position counts every generation batch (epoch 0, batches of 8 prompts consumed).
    assert trainer.data_pos == (0, int(sum(m["train/num_gen_batches"] for _, m in steps)))


def test_filtered_groups_on_the_async_rollout_pool(tmp_path):
    args = {"trainer.device": "cpu", "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 4,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "async_training.require_batches": 2,
            "trainer.n_gpus_per_node": 1, "rollout.n_gpus_per_node": 1, "trainer.test_freq": 0,
            "trainer.save_final_model": "false", "trainer.plot": "false", "trainer.default_local_dir": tmp_path / "run",
            "trainer.cache_dir": tmp_path.parent / "cache", **_dapo(tmp_path)}
    cmd = [sys.executable, "-m", "rlsp.main", *(f"{k}={v}" for k, v in args.items())]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        _check_counts(r, 4, 4, unit=0.5)  # units of ppo_mini_batch_size = 2 prompts
        assert r["async/staleness_max"] == 0.0  # extra units come from the current weights
    assert sum(r["train/num_groups_filtered"] for r in lines) > 0
