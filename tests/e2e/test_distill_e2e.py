"""End to end through the CLI: on-policy distillation (`distillation.enabled=true`, verl's keys).

A tiny teacher of other weights than the student (same char tokenizer) scores the student's samples on
the 2 policy workers at Ulysses 2 (the reference's layout); with use_task_rewards=false and k1 the
advantage is the negative sampled reverse KL alone. Both steps log the distillation metrics and the
teacher's timing; the reverse KL is clearly non-zero (the teacher differs from the student), the
start-up self-check of the teacher's sharded forward passes, and a data_source no teacher key matches
is refused before any worker has the run's config.
"""

from __future__ import annotations

import json
import math

import pytest
from test_grpo_e2e import _main

from rlsp.models.tiny import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.e2e

KEYS = ("distillation/reverse_kl", "distillation/loss", "distillation/abs_loss", "distillation/loss_min",
        "distillation/loss_max", "distillation/teacher_logprob_mean", "timing/teacher_s", "actor/pg_loss")


def test_grpo_distills_from_a_teacher(tmp_path):
    teacher = build_tiny_model(TinyModelSpec(init_std=0.3, seed=7), str(tmp_path / "teacher"))
    run = tmp_path / "distill"
    run.mkdir()
    proc = _main(run, "trainer.total_training_steps=2", "actor_rollout_ref.rollout.name=hf",
                 "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", "distillation.enabled=true",
                 f"distillation.teacher_models.teacher_model.model_path={teacher}",
                 "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_task_rewards=false")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        for key in KEYS:
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r.get(key))
        assert abs(r["distillation/reverse_kl"]) > 1e-2  # a teacher of other weights disagrees
        assert r["distillation/loss_min"] <= r["distillation/loss"] <= r["distillation/loss_max"]
    assert "sp self-check passed (teacher)" in proc.stderr


def test_unrouted_data_source_is_refused_at_start_up(tmp_path):
    teacher = build_tiny_model(TinyModelSpec(seed=7), str(tmp_path / "teacher"))
    run = tmp_path / "refused"
    run.mkdir()
    proc = _main(run, "distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={teacher}",
                 "distillation.teacher_models.teacher_model.key=gsm8k")
    assert proc.returncode != 0
    assert "data rows with teacher key(s) ['rlsp/arithmetic'] match no distillation teacher" in proc.stderr
    assert not (run / "run" / "metrics.jsonl").exists()
