"""Qwen3-Next and Qwen3.5 (text) train exactly under Ulysses: Gated DeltaNet (linear_attention) layers.

Tiny models of both families (tests/tiny_linear.py: linear and gated full-attention layers, 2 key heads read by
4 value heads; Qwen3-Next with a sparse MoE) go through the FSDP2 policy engine as
tests/distributed/test_fsdp_engine.py's model does. At Ulysses 2 each rank runs the conv and the delta rule of one
key-head group (its key head and 2 value heads) over the whole packed stream; at Ulysses 4 the 2 groups go to
ranks 0 and 1 and ranks 2 and 3 idle in those layers (full attention: 1 q head each); with 3 key heads at
Ulysses 2 the groups split unevenly (2 + 1). The loss metrics, every
parameter's full gradient and the AdamW step equal one process's, within tests/tolerances.py's bounds for the
model. One rank's logprobs against transformers' own forward of each row: tests/unit/test_linear_attention.py.
"""

from __future__ import annotations

import pytest
from _launch import run_distributed
from test_fsdp_engine import B, _assert_same_step, _rollout_batch, _train_once
from tiny_linear import FAMILIES, write_tiny_linear

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=FAMILIES)
def linear_model_and_batch(request, tmp_path_factory):
    from transformers import AutoConfig

    path = write_tiny_linear(request.param, str(tmp_path_factory.mktemp(request.param)))
    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    return path, batch, reference


@pytest.mark.parametrize("world,sp,micro", [(2, 2, 3), (4, 4, 2)])
def test_ulysses_keeps_linear_attention_loss_gradients_and_step_exact(linear_model_and_batch, world, sp, micro):
    path, batch, reference = linear_model_and_batch
    got = run_distributed(_train_once, world, path, sp, micro, batch)[0]
    _assert_same_step(got, reference, path)


def test_ulysses_keeps_uneven_key_head_groups_exact(tmp_path):
    """3 key heads (each read by 2 value heads) over Ulysses 2: rank 0 runs groups 0-1, rank 1 group 2."""
    from transformers import AutoConfig

    path = write_tiny_linear("qwen3_5_text", str(tmp_path / "uneven"), linear_num_key_heads=3, linear_num_value_heads=6)
    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    got = run_distributed(_train_once, 2, path, 2, 3, batch)[0]
    _assert_same_step(got, reference, path)
