"""The hf rollout engine samples gpt-oss from the trained distribution: the logprobs it reports for its sampled
tokens equal the trainer's (rlsp_ulysses through TokenLogprobModel, one process) on prompt + response. It loads
gpt-oss with eager attention (transformers' path that applies the attention sinks) and decodes with the model's own
forward over a KV cache; left-padded prompts of different lengths, longer than the window. Bound:
tests/tolerances.py's logprob_tol. Tiny model: tests/tiny_gpt_oss.py."""

from __future__ import annotations

import torch
from tiny_gpt_oss import HEADS, write_tiny_gpt_oss
from tolerances import logprob_tol

from rlsp.data.packing import pack_sequences
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.parallel.ulysses import build_sp_context
from rlsp.rollout.base import SamplingConfig
from rlsp.rollout.hf_engine import HFEngine


def _trainer_logprobs(path: str, rows: list[list[int]]) -> list[torch.Tensor]:
    """Per row, the trainer's logprob of each token after the first (packed rows, sp=1)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)], mask[b, :len(r)] = torch.tensor(r), 1
    packed = pack_sequences(ids, mask)
    with torch.no_grad():
        out = TokenLogprobModel(load_causal_lm(path))(packed.input_ids, packed.position_ids, packed.labels,
                                                      build_sp_context(None, packed, *HEADS))["logprobs"]
    return list(out[packed.label_mask.bool()].double().split([len(r) - 1 for r in rows]))


def test_hf_engine_logprobs_equal_the_trainers(tmp_path):
    path = write_tiny_gpt_oss(str(tmp_path / "gpt_oss"))
    engine = HFEngine(path, seed=0)
    assert engine.model.config._attn_implementation == "eager" and engine.lean is None
    prompts = [list(range(5, 8)), list(range(10, 19))]
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=10, seed=1))
    rows = [p + r for p, r in zip(prompts, out.response_ids)]
    err = 0.0
    for prompt, response, logprobs, trainer in zip(prompts, out.response_ids, out.response_logprobs,
                                                   _trainer_logprobs(path, rows)):
        assert len(response) == 10
        err = max(err, float((torch.tensor(logprobs, dtype=torch.float64) - trainer[len(prompt) - 1:]).abs().max()))
    tol = logprob_tol(engine.model.config, len(prompts[1]) + 10)
    assert err <= tol, (err, tol)
