"""The hf rollout engine samples Gemma 2 / Gemma 3 (text) from the trained distribution: its token logprobs equal
transformers' eager forward of prompt + response (Gemma 2 loads with eager attention: transformers' sdpa drops
the attention soft-capping, which moved logprobs by 0.76 on this model). Left-padded prompts of different lengths,
longer than the window. Bound: tests/tolerances.py's logprob_tol. Tiny models: tests/tiny_gemma.py."""

from __future__ import annotations

import pytest
import torch
from tiny_gemma import FAMILIES, write_tiny_gemma
from tolerances import logprob_tol
from transformers import AutoModelForCausalLM

from rlsp.rollout.base import SamplingConfig
from rlsp.rollout.hf_engine import HFEngine


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_engine_logprobs_equal_transformers_eager(tmp_path, family):
    path = write_tiny_gemma(family, str(tmp_path / family))
    engine = HFEngine(path, seed=0)
    assert engine.lean is None  # the lean decoder does not cover Gemma: the model's own forward decodes
    prompts = [list(range(5, 8)), list(range(10, 19))]
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=10, seed=1))
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    err = 0.0
    for prompt, response, logprobs in zip(prompts, out.response_ids, out.response_logprobs):
        with torch.no_grad():
            logp = reference(input_ids=torch.tensor([prompt + response])).logits[0].double().log_softmax(-1)
        expected = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None])[:, 0]
        err = max(err, float((torch.tensor(logprobs, dtype=torch.float64) - expected).abs().max()))
    tol = logprob_tol(reference.config, len(prompts[1]) + 10)
    assert err <= tol, (err, tol)
