"""Gemma 2, Gemma 3 and gpt-oss train exactly under ring attention: sliding-window, soft-capped and sink layers at
ring 2 and Ulysses 2 x ring 2.

The tiny models of tests/tiny_gemma.py (sliding and full layers, window 4 shorter than the rows and than a
zigzag chunk of the packed stream, so the window cuts boxes and skips blocks; 6 q / 2 kv heads; Gemma 2 with
attention and final-logit soft-capping; tests/tiny_gpt_oss.py: the same heads and window, attention sinks on every
layer, 4 tiny experts) go through the FSDP2 policy engine as tests/distributed/test_gemma_exact.py's
do: at ring 2 (world 2) and Ulysses 2 x ring 2 (world 4, heads 3+3 q, 1+1 kv) the loss metrics, every parameter's
full gradient (the sinks' included) and the AdamW step equal one process's, within tests/tolerances.py's bounds for the model. The block
math per element against the single-rank windowed kernel: tests/unit/test_ring_window.py.
"""

from __future__ import annotations

import pytest
from _launch import run_distributed
from test_fsdp_engine import B, _assert_same_step, _rollout_batch, _train_once
from tiny_gemma import FAMILIES, write_tiny_gemma
from tiny_gpt_oss import write_tiny_gpt_oss

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=(*FAMILIES, "gpt_oss"))
def gemma_ring_model_and_batch(request, tmp_path_factory):
    from transformers import AutoConfig

    out_dir = str(tmp_path_factory.mktemp(request.param))
    path = write_tiny_gpt_oss(out_dir) if request.param == "gpt_oss" else write_tiny_gemma(request.param, out_dir)
    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    return path, batch, reference


@pytest.mark.parametrize("world,ulysses,ring,micro", [(2, 1, 2, 3), (4, 2, 2, 2)])
def test_ring_keeps_gemma_loss_gradients_and_step_exact(gemma_ring_model_and_batch, world, ulysses, ring, micro):
    path, batch, reference = gemma_ring_model_and_batch
    got = run_distributed(_train_once, world, path, ulysses, micro, batch, None, -1, ring)[0]
    _assert_same_step(got, reference, path)
