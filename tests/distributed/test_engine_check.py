"""The GPU check's engine path (benchmarks/engine_check.py, run by scripts/gpu_check.sh) on CPU.

`scripts/gpu_check.sh --cpu` runs here: every check of the engine script runs as it runs on a GPU machine — the actor role built from a config,
inference, one update, inference again — on one gloo rank, so the script cannot rot where CI has no
GPU. And the class of bug that kept activation offload from offloading on CUDA (the engine's
`cuda` against tensors on `cuda:0`) is reproduced on CPU: the engine gets `torch.device("cpu", 0)`,
which names an index its tensors' device (`cpu`) does not, and the offload hooks are switched on
(on a CPU run they are off by design); the forward must still move the saved activations to host
memory, report their bytes, and leave the update bit for bit the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _launch import run_distributed
from bench_scripts import load_benchmark
from tolerances import logprob_tol
from transformers import AutoConfig

from rlsp.engine.offload import ActivationOffload

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def _script():
    return load_benchmark("engine_check")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from rlsp.models.tiny import build_tiny_model

    return build_tiny_model(_script().SHAPES["tiny"][0], str(tmp_path_factory.mktemp("tiny")))


def test_gpu_check_script_runs_every_engine_check_on_cpu(tmp_path, model_path):
    """`bash scripts/gpu_check.sh --cpu`: every engine option passes, and the results are recorded; an fp32
    option's logprobs and the rollout engine's after the sync are within tests/tolerances.py's bound for two
    forwards of the script's tiny model over a check's tokens (`logprob_tol`)."""
    doc = tmp_path / "benchmarks.md"
    env = {**os.environ, "PYTHON": sys.executable, "RLSP_BENCH_DOC": str(doc)}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["check"] for r in records] == list(_script().CHECKS)
    assert all(rec["ok"] for rec in records), [rec for rec in records if not rec["ok"]]
    sync = records.pop([r["check"] for r in records].index("rollout_sync"))
    tol = logprob_tol(AutoConfig.from_pretrained(model_path), max(r["tokens"] for r in records))
    assert sync["generated"] > 0 and sync["logprob_max_abs_diff_actor_vs_engine"] <= tol, (sync, tol)
    for rec in records:
        assert rec["master_dtypes"] == ["torch.float32"] and rec["weights_moved"], rec
    fp32 = [r for r in records if r["logprob_tol"] == 1e-4 and r["check"] != "baseline"]
    assert len(fp32) >= 6 and all(r["logprob_max_abs_diff"] <= tol for r in fp32), (fp32, tol)
    text = doc.read_text()
    assert "`bash scripts/gpu_check.sh --cpu`" in text and "0 failing line(s)." in text
    assert text.count('{"check": ') == len(records) + 1


def _offload_step(rank: int, world: int, path: str, device: torch.device, hooks_on: bool) -> dict:
    check = _script()
    if hooks_on:  # what an accelerator run does: the hooks are active
        ActivationOffload.active = property(lambda self: self.enabled)
    return check.run_check("activation_offload", path, "tiny", device, None)[0]


def test_offload_moves_activations_when_the_device_names_an_index(model_path):
    spec = _script().SHAPES["tiny"][0]
    plain = run_distributed(_offload_step, 1, model_path, torch.device("cpu"), False)[0]
    assert plain["activation_offload_bytes"] == 0.0  # a CPU run: hooks off, nothing to move
    got = run_distributed(_offload_step, 1, model_path, torch.device("cpu", 0), True)[0]
    # the checkpointed decoder layers' inputs of the largest micro-batch, at least: [tokens, hidden] fp32 each
    assert got["activation_offload_bytes"] >= spec.num_hidden_layers * 2 * spec.hidden_size * 4, got
    for key in ("pg_loss", "grad_norm", "policy_changed"):  # copies out and back: the same update
        assert got[key] == plain[key], (key, got[key], plain[key])
