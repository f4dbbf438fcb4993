"""The hf rollout engine samples Qwen3-Next / Qwen3.5 (text) from the trained distribution: transformers' forward
with its own cache (the Gated DeltaNet layers keep their conv and recurrent state while decoding; left-padded
prompts of different lengths) gives sampled-token logprobs equal to the trainer's packed forward of prompt +
response (rlsp.models.linear_attention, one rank), and takes the trainer's parameters by name (weight sync). Bound: tests/tolerances.py's logprob_tol. Tiny models:
tests/tiny_linear.py."""

from __future__ import annotations

import pytest
import torch
from tiny_linear import FAMILIES, HEADS, write_tiny_linear
from tolerances import logprob_tol

from rlsp.data.packing import pack_sequences
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.rollout.base import SamplingConfig
from rlsp.rollout.hf_engine import HFEngine


def _trainer_logprobs(lm, rows: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """Per row, the trainer's logprobs of the response tokens (one packed stream, one rank)."""
    from rlsp.parallel.ulysses import build_sp_context

    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, :len(row)], mask[b, :len(row)] = torch.tensor(row), 1
    packed = pack_sequences(ids, mask)
    with torch.no_grad():
        out = TokenLogprobModel(lm)(packed.input_ids, packed.position_ids, packed.labels,
                                                      build_sp_context(None, packed, *HEADS))["logprobs"]
    starts = packed.cu_seqlens.tolist()
    # logprobs[i] is the logprob of token i + 1 of its row: a response starts at row position prompt_len
    return [out[s + p - 1:s + len(r) - 1] for s, p, r in zip(starts, prompt_lens, rows)]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_engine_logprobs_equal_trainer(tmp_path, family):
    path = write_tiny_linear(family, str(tmp_path / family))
    engine = HFEngine(path, seed=0)
    assert engine.lean is None  # the lean decoder does not cover these families: the model's own forward decodes
    prompts = [list(range(5, 8)), list(range(10, 19))]
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=10, seed=1))
    rows = [p + r for p, r in zip(prompts, out.response_ids)]
    trainer_lm = load_causal_lm(path)  # Gated DeltaNet layers swapped for rlsp.models.linear_attention's
    expected = _trainer_logprobs(trainer_lm, rows, [len(p) for p in prompts])
    err = max(float((torch.tensor(lp, dtype=torch.float64) - e.double()).abs().max())
              for lp, e in zip(out.response_logprobs, expected))
    tol = logprob_tol(engine.model.config, max(len(r) for r in rows))
    assert all(len(r) == 10 for r in out.response_ids) and err <= tol, (err, tol)
    # weight sync: the trainer's parameter names and shapes are the engine's (update_weights raises on unknown ones)
    engine.update_weights((name, p.detach()) for name, p in trainer_lm.named_parameters())
