"""vLLM (CPU, in-process) serves Gemma 2 and Gemma 3 (text) exactly, before and after an in-place weight sync.

Tiny models (tests/tiny_gemma.py with head_dim 64, a vLLM CPU head size): sliding and full layers, window 4 shorter
than the prompt, Gemma 2 with attention and final-logit soft-capping. vLLM's prompt logprobs equal transformers'
eager forward within tests/tolerances.py's logprob_tol, at load and after `update_weights` with perturbed weights
sent as the trainer sends them (tied embeddings: Gemma 2's vLLM model has no output layer of its own, so
`lm_head.weight` is dropped; Gemma 3's has one, which gets it).
"""

from __future__ import annotations

import pytest
import torch
from tiny_gemma import FAMILIES, write_tiny_gemma
from tolerances import logprob_tol
from transformers import AutoModelForCausalLM

from rlsp.rollout import build_rollout_engine

pytestmark = pytest.mark.e2e
IDS = list(range(5, 30))


def _max_gap(engine, model) -> float:
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([IDS])).logits[0].double().log_softmax(-1)
    expected = logp[:-1].gather(-1, torch.tensor(IDS[1:])[:, None])[:, 0]
    return float((torch.tensor(engine.prompt_logprobs(IDS)[1:], dtype=torch.float64) - expected).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_serves_gemma_and_takes_synced_weights(tmp_path, family):
    pytest.importorskip("vllm")
    path = write_tiny_gemma(family, str(tmp_path / family), hidden_size=128, head_dim=64, num_attention_heads=2,
                            num_key_value_heads=1)
    engine = build_rollout_engine("vllm", path, dtype="float32", max_model_len=64, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    tol = logprob_tol(model.config, len(IDS))
    assert _max_gap(engine, model) <= tol
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    named = dict(model.named_parameters())
    named["lm_head.weight"] = named["model.embed_tokens.weight"]  # what the FSDP engine sends with tied embeddings
    engine.update_weights((name, p.detach().clone()) for name, p in named.items())
    gap = _max_gap(engine, model)
    assert gap <= tol, (gap, tol)
