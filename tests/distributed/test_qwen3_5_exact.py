"""Qwen3.5 / Qwen3.5-MoE wrapper checkpoints (model_type qwen3_5 / qwen3_5_moe: text_config + vision_config) train
text-only exactly under Ulysses.

A tiny wrapper checkpoint of each (tests/tiny_qwen3_5.py: saved by transformers' ForConditionalGeneration class, so
its weights carry `model.language_model.*` / `model.visual.*` names) goes through the FSDP2 policy engine as
tests/distributed/test_linear_exact.py's text models do: rlsp loads its text causal LM (Gated DeltaNet and gated
full-attention layers). At Ulysses 2 the loss metrics, every parameter's full gradient and the AdamW step equal one
process's, within tests/tolerances.py's bounds for the text model. One rank's logprobs against transformers'
wrapper forward: tests/unit/test_qwen3_5_wrapper.py.
"""

from __future__ import annotations

import pytest
from _launch import run_distributed
from test_fsdp_engine import B, _assert_same_step, _rollout_batch, _train_once
from tiny_qwen3_5 import WRAPPERS, write_text_config, write_tiny_qwen3_5

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("family", WRAPPERS)
def test_ulysses_2_keeps_the_wrapper_text_model_exact(tmp_path, family):
    from transformers import AutoConfig

    path = write_tiny_qwen3_5(family, str(tmp_path / family))
    batch = _rollout_batch(AutoConfig.from_pretrained(path).text_config.vocab_size)
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    assert not any(".visual." in k for k in reference[1]) and any("linear_attn" in k for k in reference[1])
    got = run_distributed(_train_once, 2, path, 2, 3, batch)[0]
    _assert_same_step(got, reference, write_text_config(path, str(tmp_path / "text_config")))
