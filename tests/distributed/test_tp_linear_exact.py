"""Tensor parallelism is exact for the Gated DeltaNet families: qwen3_next, qwen3_5_text, qwen3_5_moe_text at tp 2.

The tiny models of tests/tiny_linear.py (linear_attention layers around one gated full-attention layer with per-head
q/k norms; qwen3_next and qwen3_5_moe_text with a sparse MoE of 3 experts plus a gated shared expert) go through the
FSDP2 policy engine at tp 2 with and without sequence-parallel activations, and at tp 2 x Ulysses 2 on 4 ranks, on
tests/distributed/test_fsdp_engine.py's packed rows of unequal lengths: the loss metrics, every parameter's full
gradient (the sharded projections, out_proj, the replicated conv, decay, norm weights and Qwen3.5's in_proj_qkv,
routers, experts) and the AdamW step equal one process's within tests/tolerances.py's bounds for the model; for the
MoE families the expert load the engine counts is tp times one process's, count by count (every tp rank routes the
same tokens; the batch is checked to route every token well clear of a top-k tie), and its metrics equal. Key-head
groups: qwen3_5_text with 4 key heads (8 value heads), so a tp rank holds 2 groups and each Ulysses rank of it one;
the other two with 2 key heads, so a tp rank holds 1 group and at Ulysses 2 one sp rank of it idles in those layers.
One launch per layout runs every family (the processes start once).
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import B, _assert_same_step, _rollout_batch, policy_engine
from test_moe_exact import _assert_same_step_and_load, margin_checked_batch, step_and_count
from tiny_linear import FAMILIES, write_tiny_linear

pytestmark = pytest.mark.distributed

# qwen3_5_text with 2 key-head groups per tp rank (each Ulysses rank of it runs one)
SHAPES = {"qwen3_5_text": dict(linear_num_key_heads=4, linear_num_value_heads=8)}
MOE_FAMILIES = ("qwen3_next", "qwen3_5_moe_text")  # a sparse MoE block in every layer


def _train_families(rank: int, world: int, cases: dict, ulysses: int, tp: int, seq_par: bool, micro: int):
    """`step_and_count` of every family in `cases` ({family: (path, batch)}) on one layout: {family: result}."""
    dims = layout_dims(ulysses=ulysses, tp=tp, sequence_parallel=seq_par)
    out = {family: step_and_count(policy_engine(path, dims), dims, batch, micro)
           for family, (path, batch) in cases.items()}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def linear_cases(tmp_path_factory):
    """({family: (path, batch)}, one process's step of each)."""
    from transformers import AutoConfig

    cases = {}
    for family in FAMILIES:
        path = write_tiny_linear(family, str(tmp_path_factory.mktemp(f"tp_{family}")), **SHAPES.get(family, {}))
        moe = family in MOE_FAMILIES
        batch = margin_checked_batch(path, family) if moe else _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
        cases[family] = (path, batch)
    reference = run_distributed(_train_families, 1, cases, 1, 1, True, B)[0]
    return cases, reference


def _assert_families(got: dict, reference: dict, cases: dict, tp: int = 2) -> None:
    assert set(got) == set(FAMILIES)
    for family, (metrics, grads, params, counts_LE) in got.items():
        path, batch = cases[family]
        if family not in MOE_FAMILIES:
            _assert_same_step((metrics, grads, params), reference[family][:3], path)
            continue
        assert torch.equal(counts_LE, tp * reference[family][3]), (family, counts_LE, reference[family][3])
        _assert_same_step_and_load((metrics, grads, params, counts_LE / tp), reference[family], path, batch)


@pytest.mark.parametrize("seq_par,micro", [(True, 3), (False, B)], ids=["seqpar", "no_seqpar"])
def test_tp2_keeps_linear_attention_families_exact(linear_cases, seq_par, micro):
    cases, reference = linear_cases
    _assert_families(run_distributed(_train_families, 2, cases, 1, 2, seq_par, micro)[0], reference, cases)


def test_tp2_x_ulysses2_keeps_linear_attention_families_exact(linear_cases):
    """4 ranks: Ulysses 2 over tp 2 with sequence-parallel activations: a rank's Gated DeltaNet runs its Ulysses
    share of its tp rank's key-head groups, its full attention 1 of its tp rank's 2 q heads (the kv head replicated)."""
    cases, reference = linear_cases
    _assert_families(run_distributed(_train_families, 4, cases, 2, 2, True, 3)[0], reference, cases)
