"""The hf rollout engine samples a tiny DeepSeek-V3 (multi-latent attention: transformers caches the compressed
latents; MoE) from the trained distribution: its token logprobs equal transformers' eager forward of prompt +
response, and rlsp's trainer-side packed forward (rlsp_ulysses) of the same rows. Left-padded prompts of different
lengths. Bound: tests/tolerances.py's logprob_tol. Tiny model: tests/tiny_deepseek.py."""

from __future__ import annotations

import torch
from tiny_deepseek import HEADS, write_tiny_deepseek
from tolerances import logprob_tol
from transformers import AutoModelForCausalLM

from rlsp.data.packing import pack_sequences
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.parallel.ulysses import build_sp_context
from rlsp.rollout.base import SamplingConfig
from rlsp.rollout.hf_engine import HFEngine


def _trainer_logprobs(path: str, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each row's next-token logprobs from rlsp's training forward (one packed stream, one rank)."""
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
    packed = pack_sequences(ids, mask)
    with torch.no_grad():
        out = TokenLogprobModel(load_causal_lm(path))(packed.input_ids, packed.position_ids, packed.labels,
                                                      build_sp_context(None, packed, HEADS, HEADS))["logprobs"]
    return list(out[packed.label_mask.bool()].double().split([len(r) - 1 for r in rows]))


def test_hf_engine_logprobs_equal_transformers_and_trainer(tmp_path):
    path = write_tiny_deepseek("v3", str(tmp_path / "v3"))
    engine = HFEngine(path, seed=0)
    assert engine.lean is None  # the lean decoder does not cover DeepSeek: the model's own forward decodes
    prompts = [list(range(5, 8)), list(range(10, 19))]
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=10, seed=1))
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    rows = [p + r for p, r in zip(prompts, out.response_ids)]
    trained = _trainer_logprobs(path, rows)
    err_ref = err_trainer = 0.0
    for prompt, response, logprobs, train_lp in zip(prompts, out.response_ids, out.response_logprobs, trained):
        assert len(response) == 10
        with torch.no_grad():
            logp = reference(input_ids=torch.tensor([prompt + response])).logits[0].double().log_softmax(-1)
        expected = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None])[:, 0]
        got = torch.tensor(logprobs, dtype=torch.float64)
        err_ref = max(err_ref, float((got - expected).abs().max()))
        err_trainer = max(err_trainer, float((got - train_lp[len(prompt) - 1:]).abs().max()))
    tol = logprob_tol(reference.config, len(prompts[1]) + 10)
    assert err_ref <= tol and err_trainer <= tol, (err_ref, err_trainer, tol)
