"""The training path on CUDA (bf16 compute over fp32 master weights): skipped without a GPU.

Each test runs one of the GPU benchmark scripts in a subprocess at a small size and checks what it
reports against a reference: the engine step (loss finite, fp32 masters, an lr-1e-6 step moves the
weights), packed attention against exact fp32 attention, the logprob head against full logits.
Bounds from tests/tolerances.py: the kernels accumulate in fp32 and round to bf16 what they store, so a
result carries one bf16 rounding per rounded operand (u_bf16 = 2^-8 each, derivation 3).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerances import roundoff_rtol, scalar_tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bf16_step_over_fp32_masters_moves_weights() -> None:
    r = _run("gpu_train_step.py", "--model", "smoke", "--tokens", "8192", "--seq-len", "1024", "--lr", "1e-6")
    assert r["oom"] is False and r["loss_finite"] is True
    assert r["master_dtype"] == ["torch.float32"]
    assert r["frac_weights_moved"] > 0.97, r  # bf16 weights would round most 1e-6 updates away


def test_one_rank_share_at_sp4_runs() -> None:
    r = _run("gpu_train_step.py", "--model", "smoke", "--tokens", "8192", "--world", "8", "--sp", "4", "--grad-ckpt")
    assert r["oom"] is False and r["local_tokens"] == 2048


@pytest.mark.parametrize("heads", [("14", "2"), ("4", "1"), ("6", "6")])
def test_packed_attention_matches_fp32_reference(heads: tuple[str, str]) -> None:
    q, kv = heads
    r = _run("gpu_attention.py", "--tokens", "8192", "--seq-len", "3000", "--impl", "rlsp", "--q-heads", q, "--kv-heads", kv)
    assert r["ok"], r
    # the reference takes the same bf16 inputs in fp32: the kernel rounds P (dS backward) and its result
    rtol = roundoff_rtol(reduction=1, stages=2, dtype=torch.bfloat16)
    assert r["max_abs_err"] <= scalar_tol(r["ref_max_abs"], rtol), (r, rtol)
    assert r["dq_max_rel_err"] <= rtol, (r, rtol)


def test_chunked_logprob_head_matches_full_logits() -> None:
    r = _run("gpu_logprob.py", "--tokens", "4096", "--vocab", "32000", "--hidden", "256", "--chunk", "1000")
    assert not r["chunked"]["oom"] and not r["naive"]["oom"]
    # both heads round the same fp32-accumulated bf16 matmul: a logit may land on the neighbouring bf16
    # value where the two sums straddle a rounding boundary, 2 u_bf16 of the largest logit (the script's
    # weights are 0.02 N(0, 1) over 256 hidden units: logits of sd 0.32, at most ~6 sd); gradients round
    # dlogits and their result once each
    logit_scale = 6 * 0.02 * 256**0.5
    tol = scalar_tol(logit_scale, roundoff_rtol(reduction=1, stages=1, dtype=torch.bfloat16))
    assert r["max_logprob_diff"] <= tol and r["max_entropy_diff"] <= tol, (r, tol)
    grad_rtol = roundoff_rtol(reduction=1, stages=2, dtype=torch.bfloat16)
    assert r["grad_hidden_rel_diff"] <= grad_rtol and r["grad_weight_rel_diff"] <= grad_rtol, (r, grad_rtol)
