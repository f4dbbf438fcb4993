"""benchmarks/moe_step.py's one-layer comparison on CPU (benchmarks/moe_layer.py): transformers' per-expert loop and its grouped matmul compute
the same qwen3_moe MoE layer (output, input gradient, every router and expert gradient) within the fp32 roundoff
bound, and routing replay (rlsp.engine.router_replay) of the recorded routes reproduces the layer's output.

Bound (tests/tolerances.py derivation 1): the two paths differ only in how they order the sums of the router (H
terms), gate/up (H), down (I) and the top-k combine, i.e. 4 stages forward and as many again backward; a weight
gradient also sums over the tokens. A wrong grouping offset (a token sent to a neighbouring expert) moves an output
by O(1), far above it.
"""

from __future__ import annotations

import math

import pytest
import torch
from bench_scripts import load_benchmark
from tolerances import assert_grads_close, assert_tensor_close, roundoff_rtol

TOKENS = 96


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("moe_layer")


@pytest.fixture(scope="module")
def line(bench):
    return bench.compare_layer("tiny", TOKENS, torch.device("cpu"), torch.float32, reps=1)


def test_grouped_and_per_expert_paths_agree_every_element(bench, line):
    shape = bench.LAYER_SHAPES["tiny"]
    reduction = max(shape["hidden_size"], shape["moe_intermediate_size"])
    eager, grouped = line["tensors"]["eager"], line["tensors"]["grouped_mm"]
    assert_tensor_close(grouped["out"], eager["out"], roundoff_rtol(reduction=reduction, stages=4))
    assert_tensor_close(grouped["x_grad"], eager["x_grad"], roundoff_rtol(reduction=reduction, stages=8))
    grad_rtol = roundoff_rtol(reduction=max(reduction, TOKENS), stages=8)
    assert any("experts" in n for n in eager["grads"]) and any("gate" in n for n in eager["grads"])
    assert_grads_close(grouped["grads"], eager["grads"], grad_rtol)
    assert float(eager["out"].abs().max()) > 1e-3  # a layer that computes something


def test_bench_line_is_finite_and_within_its_own_bound(line):
    assert line["out_within"] and line["x_grad_within"] and line["replay_out_equal"], line
    for key in ("eager_ms", "grouped_mm_ms", "eager_tokens_per_s", "grouped_mm_tokens_per_s", "record_ms",
                "replay_ms", "out_bound", "x_grad_bound", "eager_peak_mib"):
        assert math.isfinite(line[key]) and line[key] > 0, (key, line[key])
    assert line["tokens"] == TOKENS and line["grouped_kernel"]
