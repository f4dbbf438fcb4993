"""DeepSeek-V3 and DeepSeek-V2 (multi-latent attention, MoE) train exactly under Ulysses.

Tiny models (tests/tiny_deepseek.py: q/k head dim 10, v head dim 6, 6 heads, a dense layer then two routed-MoE
layers with a shared expert, yarn mscale folded into the attention scale; DeepSeek-V3 with grouped top-k routing,
DeepSeek-V2 with its greedy router) go through the FSDP2 policy engine as tests/distributed/test_fsdp_engine.py's
model does: at Ulysses 2 (3+3 heads) and Ulysses 4 (uneven: 2+2+1+1 heads) the fused all-to-all carries q, k and v
with their own head dims, and the loss metrics, every parameter's full gradient and the AdamW step equal one
process's, within tests/tolerances.py's bounds for the model. One rank's forward against transformers' eager
forward: tests/unit/test_deepseek_mla.py.
"""

from __future__ import annotations

import pytest
from _launch import run_distributed
from test_fsdp_engine import B, _assert_same_step, _rollout_batch, _train_once
from tiny_deepseek import write_tiny_deepseek

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=("v3", "v2"))
def deepseek_model_and_batch(request, tmp_path_factory):
    from transformers import AutoConfig

    path = write_tiny_deepseek(request.param, str(tmp_path_factory.mktemp(f"deepseek_{request.param}")))
    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    return path, batch, reference


@pytest.mark.parametrize("world,sp,micro", [(2, 2, 3), (4, 4, 2)])
def test_ulysses_keeps_deepseek_loss_gradients_and_step_exact(deepseek_model_and_batch, world, sp, micro):
    path, batch, reference = deepseek_model_and_batch
    got = run_distributed(_train_once, world, path, sp, micro, batch)[0]
    _assert_same_step(got, reference, path)
