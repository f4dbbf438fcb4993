"""benchmarks/gpu_families.py end to end on CPU at its small shape: rlsp's packed logprobs equal transformers' per-row
forward within the script's bound, and forward+backward gives finite numbers (Gemma 2: soft-capping and sliding
windows; Qwen3-Next: Gated DeltaNet and MoE). The CUDA run (bf16, mid shapes) is `scripts/gpu_check.sh --only
families`."""

from __future__ import annotations

import math

import pytest
import torch
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def gpu_families():
    return load_benchmark("gpu_families")


def test_cpu_run_is_exact_and_finite(gpu_families, capsys):
    records = gpu_families.main(["--device", "cpu", "--families", "gemma2,qwen3_next", "--tokens", "256",
                                 "--seq-len", "64"])
    assert [r["family"] for r in records] == ["gemma2", "qwen3_next"]
    for r in records:
        assert r["ok"] and r["exact_ok"] and r["finite"], r
        assert 0 <= r["max_abs_diff"] <= r["bound"] and r["bound"] < 1e-3, r
        assert math.isfinite(r["fwd_bwd_s"]) and math.isfinite(r["loss"]) and r["loss"] > 0, r
        assert r["rows"] == [64, 48, 32, 17] and r["dtype"] == "float32", r
    assert records[0]["kernel"] == "torch" and records[1]["kernel"] == "torch+sdpa"
    assert len(capsys.readouterr().out.strip().splitlines()) == 2  # one JSON line per family


def test_bound_formula_in_bf16(gpu_families):
    config = gpu_families.family_config("gemma3", small=False)
    bound, formula = gpu_families.logprob_bound(config, 4096, torch.bfloat16, 3.0)
    n = 32000  # the vocabulary is the longest reduction
    want = 2 * 17 * (2**-8 + math.sqrt(n) * 2**-24) * math.log(32000)
    assert bound == pytest.approx(want, rel=1e-12) and "L=4" in formula and "V=32000" in formula


def test_unknown_family_is_refused_by_name(gpu_families):
    with pytest.raises(SystemExit):
        gpu_families.parse_args(["--families", "gemma2,llama9"])
