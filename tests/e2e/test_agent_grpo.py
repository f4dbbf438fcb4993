"""End to end with agent loops: 2 GRPO steps on 2 CPU workers (Ulysses sp=2, vLLM rollouts, tiny model), every
sample running a user environment loop (tests/data/agent_loops/calculator_env.py, registered from its YAML)
that calls the calculator tool (from a verl-style tool YAML) after each policy turn and feeds the result
back as a tool turn; tool step rewards train (multi_turn.use_step_rewards=true). Checked per step: the run
exits 0 and the sp self-check passes; turns, tool calls and step rewards are what the loop did (each tool
call earns the configured 0.25); no tool error; the trainer's logprobs equal vLLM's on every policy token
(masked-out tool turns in between); trajectories include tokens the policy did not write."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from test_sequence_layouts_e2e import run_logprob_tol

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
LOOPS = REPO / "tests" / "data" / "agent_loops"
STEP_REWARD = 0.25  # tests/data/agent_loops/tools.yaml: reward_on_success
OVERRIDES = {
    "actor_rollout_ref.rollout.multi_turn.enable": "true",
    "actor_rollout_ref.rollout.agent.default_agent_loop": "calculator_env",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(LOOPS / "loops.yaml"),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(LOOPS / "tools.yaml"),
    "actor_rollout_ref.rollout.multi_turn.use_step_rewards": "true",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
    "data.max_response_length": 64,  # three 4-token turns and two tool turns (~21 tokens each) always fit
    "trainer.total_training_steps": 2,
    "trainer.test_freq": 2,
    "trainer.save_final_model": "false",
    "trainer.plot": "false",
}


def test_grpo_with_an_environment_loop_and_tools(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlsp.main", *(f"{k}={v}" for k, v in OVERRIDES.items()),
           f"trainer.default_local_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    output = proc.stderr + proc.stdout
    assert proc.returncode == 0, output[-4000:]
    assert "sp self-check passed (actor)" in output, output[-4000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        for key in ("actor/pg_loss", "actor/entropy", "reward/mean", "agent/engine_busy_s"):
            assert math.isfinite(r[key]), (r["step"], key, r[key])
        # every trajectory: three policy turns with a calculator call after the first two (the budget fits
        # them whatever the policy writes, so this does not depend on what is sampled)
        assert r["agent/num_turns/max"] == 3 and r["agent/num_turns/mean"] == 3
        assert r["agent/tool_calls/mean"] == 2 and r["agent/truncated/mean"] == 0
        assert r["agent/step_reward/mean"] == pytest.approx(STEP_REWARD * r["agent/tool_calls/mean"], abs=1e-6)
        assert r["agent/tool_error_rate"] == 0.0
        # vLLM's logprobs against the trainer's: two forwards of the run's model (tests/tolerances.py)
        assert r["rollout/logprob_diff_max"] <= run_logprob_tol(run_dir), r["rollout/logprob_diff_max"]
        # policy tokens are fewer than the trajectories' tokens (tool turns are attended, not trained on)
        rows = 16 * 8  # data.train_batch_size x rollout.n of configs/rlsp.yaml
        assert r["throughput/response_tokens"] < r["response_length/mean"] * rows
    val = lines[-1]
    assert val["val/agent/num_turns/mean"] == 3 and "val/accuracy" in val
