"""DeepSeek-V3 (multi-latent attention, MoE) trains exactly under ring attention: ring 2 and Ulysses 2 x ring 2.

The tiny model of tests/tiny_deepseek.py (q/k head dim 10 = 6 nope + 4 rope, v head dim 6, 6 heads, a dense layer
then two routed-MoE layers) goes through the FSDP2 policy engine as tests/distributed/test_deepseek_exact.py's
does: at ring 2 (world 2) and Ulysses 2 x ring 2 (world 4, 3+3 heads) the ring's K/V blocks carry k and v with their
own head dims (rlsp/parallel/ring_grads.py `pack_kv`; the CPU fused kernel with v zero-padded per tile), and the loss
metrics, every parameter's full gradient and the AdamW step equal one process's, within tests/tolerances.py's
bounds for the model. The kernel per element against dense attention with Dv != Dk:
tests/distributed/test_ring_window_exact.py, tests/unit/test_ring_mla.py.
"""

from __future__ import annotations

import pytest
from _launch import run_distributed
from test_fsdp_engine import B, _assert_same_step, _rollout_batch, _train_once
from tiny_deepseek import write_tiny_deepseek

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def deepseek_ring_model_and_batch(tmp_path_factory):
    from transformers import AutoConfig

    path = write_tiny_deepseek("v3", str(tmp_path_factory.mktemp("deepseek_ring")))
    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    return path, batch, reference


@pytest.mark.parametrize("world,ulysses,ring,micro", [(2, 1, 2, 3), (4, 2, 2, 2)])
def test_ring_keeps_deepseek_loss_gradients_and_step_exact(deepseek_ring_model_and_batch, world, ulysses, ring,
                                                           micro):
    path, batch, reference = deepseek_ring_model_and_batch
    got = run_distributed(_train_once, world, path, ulysses, micro, batch, None, -1, ring)[0]
    _assert_same_step(got, reference, path)
