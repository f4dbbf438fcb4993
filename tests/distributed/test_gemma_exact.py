"""Gemma 2, Gemma 3 (text) and gpt-oss train exactly under Ulysses: sliding-window, soft-capped and sink layers.

Tiny models of the three families (tests/tiny_gemma.py, tests/tiny_gpt_oss.py: sliding and full layers, window 4
shorter than the rows, 6 q / 2 kv heads; Gemma 2 with attention and final-logit soft-capping; gpt-oss with
attention sinks, 4 tiny experts and an untied output layer) go through the FSDP2 policy engine
as tests/distributed/test_fsdp_engine.py's model does: at Ulysses 2 (heads 3+3 q, 1+1 kv) and Ulysses 4
(uneven heads 2+2+1+1 q, kv replicated) the loss metrics, every parameter's full gradient and the AdamW
step equal one process's (the sinks' gradients included: each rank holds its q heads' slice), within
tests/tolerances.py's bounds for the model. One rank's logprobs against transformers' own forward:
tests/unit/test_window_attention.py, tests/unit/test_gpt_oss_attention.py.
"""

from __future__ import annotations

import pytest
from _launch import run_distributed
from test_fsdp_engine import B, _assert_same_step, _rollout_batch, _train_once
from tiny_gemma import FAMILIES, write_tiny_gemma
from tiny_gpt_oss import write_tiny_gpt_oss

pytestmark = pytest.mark.distributed

EXACT_FAMILIES = (*FAMILIES, "gpt_oss")


def _write_tiny(family: str, out_dir: str) -> str:
    return write_tiny_gpt_oss(out_dir) if family == "gpt_oss" else write_tiny_gemma(family, out_dir)


@pytest.fixture(scope="module", params=EXACT_FAMILIES)
def gemma_model_and_batch(request, tmp_path_factory):
    from transformers import AutoConfig

    path = _write_tiny(request.param, str(tmp_path_factory.mktemp(request.param)))
    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    return path, batch, reference


@pytest.mark.parametrize("world,sp,micro", [(2, 2, 3), (4, 4, 2)])
def test_ulysses_keeps_gemma_loss_gradients_and_step_exact(gemma_model_and_batch, world, sp, micro):
    path, batch, reference = gemma_model_and_batch
    got = run_distributed(_train_once, world, path, sp, micro, batch)[0]
    _assert_same_step(got, reference, path)
