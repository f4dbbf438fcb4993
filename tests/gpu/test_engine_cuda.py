"""The actor role on CUDA with every engine option (benchmarks/engine_check.py, as scripts/gpu_check.sh
runs it): one rank of a real cpu:gloo,cuda:nccl process group; skipped without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_scripts import load_benchmark
from tolerances import logprob_tol

from rlsp.models.tiny import build_tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_check.py"


def _script():
    return load_benchmark("engine_check")


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--model", "small"],
                         capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, out.stderr[-3000:]
    return {r["check"]: r for r in lines}


@pytest.mark.parametrize("check", ["baseline", "bf16", "checkpointing", "tiled_mlp", "activation_offload", "lora",
                                   "logprob_chunk", "token_budget", "param_offload", "everything_bf16"])
def test_engine_option_on_cuda(records, check):
    rec = records[check]
    assert rec["ok"], rec
    assert rec["master_dtypes"] == ["torch.float32"] and rec["weights_moved"], rec


def test_weight_sync_into_the_rollout_engine_and_its_sleep(records):
    rec = records["rollout_sync"]
    assert rec["ok"], rec
    # two fp32 forwards (the actor's and the HF engine's) of the script's "small" model over a prompt and
    # its greedy tokens: tests/tolerances.py's bound (the script's own 1e-4 check is in rec["ok"])
    spec, (prompt, response) = _script().SHAPES["small"]
    tol = logprob_tol(build_tiny_config(spec, spec.vocab_size, 0, [1]), prompt + min(response, 8))
    assert rec["logprob_max_abs_diff_actor_vs_engine"] <= tol and rec["engine_sleep_freed_gib"] > 0, (rec, tol)


def test_activation_offload_moves_bytes_to_host(records):
    for check in ("activation_offload", "everything_bf16"):
        assert records[check]["activation_offload_bytes"] > 0, records[check]
    assert records["param_offload"]["param_shards_on_host"] is True
