"""End to end through the CLI: GRPO scored by a reward model (`reward_model.enable=true`).

A tiny random sequence-classification model with a chat template of its own (so every sample is
re-rendered in its format) scores the responses on the 2 policy workers, sharded at Ulysses 2: the
start-up self-check of its sharded forward passes, both steps train on its scores (real-valued
rewards, not the 0/1 of the arithmetic task's rule reward), and validation still uses the rule reward
(verl's rule).
"""

from __future__ import annotations

import json
import math

import pytest
from test_grpo_e2e import _main
from test_sequence_layouts_e2e import run_logprob_tol

from rlsp.models.tiny import TinyModelSpec, build_tiny_reward_model

pytestmark = pytest.mark.e2e

RM_TEMPLATE = ("{%- for m in messages -%}{{ m['role'] | capitalize + ': ' + m['content'] + '\n' }}{%- endfor -%}"
               "{%- if add_generation_prompt -%}{{ 'Assistant: ' }}{%- endif -%}")


SAMPLES = 4 * 4  # data.train_batch_size x rollout.n (tests/e2e/test_grpo_e2e.SMALL)


def _run_scored(tmp_path, name: str, *overrides: str) -> tuple[str, list[dict]]:
    """GRPO for 2 steps scored by a tiny random reward model with a chat template of its own: the
    run's stderr and metrics, after checking it ended well and every step trained on model scores."""
    rm = build_tiny_reward_model(TinyModelSpec(init_std=0.3, seed=5), str(tmp_path / "rm"), chat_template=RM_TEMPLATE)
    run = tmp_path / name
    run.mkdir()
    proc = _main(run, "trainer.total_training_steps=2", "reward_model.enable=true", f"reward_model.model.path={rm}",
                 *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        mean = r["reward/mean"]
        assert math.isfinite(mean) and math.isfinite(r["actor/pg_loss"])
        assert abs(mean * SAMPLES - round(mean * SAMPLES)) > 1e-6  # model scores, not 0/1 rule rewards
    assert 0.0 <= lines[0]["val/accuracy"] <= 1.0  # validation: the rule reward of the arithmetic task
    return proc.stderr, lines


def test_grpo_trains_on_reward_model_scores(tmp_path):
    stderr, lines = _run_scored(tmp_path, "grpo", "actor_rollout_ref.rollout.name=hf",
                                "reward_model.ulysses_sequence_parallel_size=2", "reward_model.micro_batch_size_per_gpu=4")
    assert "sp self-check passed (reward_model)" in stderr
    assert "reward_model dp=1 ulysses=2" in stderr
    assert all(r["reward/errors"] == 0.0 for r in lines)


def test_grpo_trains_on_reward_loop_scores(tmp_path):
    """verl's reward loop (use_reward_loop=true): the same reward model served by one vLLM pooling engine
    split over both policy workers (reward tp=2), validation's rule rewards scored by 2 reward-loop processes."""
    _run_scored(tmp_path, "grpo_loop", "actor_rollout_ref.rollout.name=hf", "reward_model.use_reward_loop=true",
                "reward_model.rollout.name=vllm", "reward_model.rollout.dtype=float32",
                "reward_model.rollout.tensor_model_parallel_size=2", "reward_model.num_workers=2")


def test_grpo_reward_loop_beside_a_tp_rollout(tmp_path):
    """verl's reward-loop commands with rollout TP 2 and reward TP 1: the vLLM rollout engine spans both
    policy workers, and the reward engines run in a process of their own beside each worker."""
    stderr, lines = _run_scored(tmp_path, "grpo_servers", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                "reward_model.use_reward_loop=true", "reward_model.rollout.dtype=float32",
                                "reward_model.rollout.tensor_model_parallel_size=1")
    assert "2 reward engine processes started (one beside each policy worker)" in stderr
    assert "reward_model in processes of its own dp=2" in stderr
    # vLLM's logprobs against the trainer's: two forwards of the run's model (tests/tolerances.py)
    assert all(r["rollout/logprob_diff"] <= run_logprob_tol(tmp_path / "grpo_servers" / "run") for r in lines)
