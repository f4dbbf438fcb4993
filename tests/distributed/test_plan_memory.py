"""The planner's memory model against the measured peak of real engine steps (benchmarks/plan_memory.py):
three of the benchmark's layouts (one an actor-only run with a smaller logprob chunk), each within 15 % of the
measured peak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_memory  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name", ["one rank, bf16, checkpointing", "tp 2, sequence-parallel",
                                  "one rank, actor only, logprob chunk 256"])
def test_estimate_within_15_percent_of_the_measured_peak(name):
    case = next(c for c in plan_memory.CASES if c.name == name)
    results = run_distributed(plan_memory.measure, case.world, case)
    measured = max(r["peak"] for r in results)
    estimate = plan_memory.estimate(case)
    assert all(r["at_step_start"] > 0 for r in results)  # the state built before the step is counted
    assert abs(estimate - measured) <= 0.15 * measured, (name, estimate / 2**20, measured / 2**20)


def test_offloaded_state_is_where_the_planner_puts_it():
    """benchmarks/plan_offload.py on CPU: with FSDP parameter offload the parameter shards, gradients and AdamW
    state counted after a step come to the planner's host term, 16 bytes per parameter, exactly."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_offload.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--tokens", "512"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    offloaded = result["runs"][1]
    assert offloaded["param_offload"] and result["checks"]["host_bytes_equal_term"]
    assert offloaded["counted_bytes_by_device"] == {"cpu": 16 * result["params"]}
