"""The transformers rollout engine's decoding loop against transformers' own `generate` and warpers.

* greedy decoding: token for token what `generate` returns (ragged, left-padded prompts, n > 1);
* sampling: every reported logprob equals the processed distribution (temperature, top-k, top-p as
  transformers' logits warpers apply them) recomputed by one full forward over prompt + response,
  without the KV cache (float64 model; the cached and uncached forwards are two kernels of one model:
  tests/tolerances.py's `logprob_tol` in fp64, at the scale of the step's logits);
* stops: a row ends at its first stop token ("stop"), else after max_tokens ("length");
* `processed_logprobs` equals transformers' warpers element by element on random logits.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import logprob_tol
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.rollout.base import SamplingConfig
from rlsp.rollout.hf_engine import HFEngine
from rlsp.rollout.sampling import processed_logprobs, sample_next

PROMPTS = [[5, 9, 12, 7], [20], [33, 4, 8], [11, 11, 40, 41, 42, 43]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # A larger init than the default makes the distributions peaked: greedy ties cannot happen.
    return build_tiny_model(TinyModelSpec(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                          num_key_value_heads=1, init_std=0.5, seed=3),
                            str(tmp_path_factory.mktemp("hf_engine")))


MAX_TOKENS = 12  # the longest response here: a row is at most 6 + 12 tokens


def _tol(model, logits: torch.Tensor) -> float:
    """A cached decode's logprob against one full forward, fp64 (derivation 4), at the logits' scale."""
    return logprob_tol(model.config, max(map(len, PROMPTS)) + MAX_TOKENS, dtype=torch.float64,
                       value_scale=float(logits.abs().max()))


def reference_warpers(s: SamplingConfig) -> LogitsProcessorList:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(s.temperature)])
    if s.top_k > 0:
        warpers.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1.0:
        warpers.append(TopPLogitsWarper(s.top_p))
    return warpers


def test_greedy_equals_transformers_generate(model_dir):
    engine = HFEngine(model_dir, dtype=torch.float64)
    sampling = SamplingConfig(n=2, temperature=0.0, max_tokens=12)
    engine.stop_ids = set()  # compare whole rows (generate below ignores EOS too)
    out = engine.generate(PROMPTS, sampling)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids, mask = (x.repeat_interleave(2, dim=0) for x in engine._left_pad(PROMPTS))
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
        max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=engine.pad_id,
        eos_token_id=None, bos_token_id=None, return_dict_in_generate=True))
    assert out.response_ids == ref.sequences[:, ids.shape[1]:].tolist()
    assert out.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3] and set(out.finish_reason) == {"length"}
    # greedy logprobs: under the unscaled logits of the step (one full float64 forward per row)
    for row, (ids, lps) in enumerate(zip(out.response_ids, out.response_logprobs)):
        prompt = PROMPTS[row // 2]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        err, tol = float((torch.tensor(lps, dtype=torch.float64) - expected).abs().max()), _tol(model, logits)
        assert err <= tol, (row, err, tol)  # measured: <= 1/400 of it


@pytest.mark.parametrize("sampling", [
    SamplingConfig(n=3, temperature=1.0, max_tokens=10, seed=1),
    SamplingConfig(n=3, temperature=0.7, top_k=5, max_tokens=10, seed=2),
    SamplingConfig(n=3, temperature=1.3, top_p=0.8, max_tokens=10, seed=3),
    SamplingConfig(n=2, temperature=0.9, top_k=20, top_p=0.6, max_tokens=10, seed=4),
])
def test_sampled_logprobs_equal_a_full_forward_through_transformers_warpers(model_dir, sampling):
    engine = HFEngine(model_dir, dtype=torch.float64)
    engine.stop_ids = set()
    out = engine.generate(PROMPTS, sampling)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    warpers = reference_warpers(sampling)
    for row, (ids, lps) in enumerate(zip(out.response_ids, out.response_logprobs)):
        prompt = PROMPTS[out.prompt_index[row]]
        assert len(ids) == sampling.max_tokens
        seq = torch.tensor([prompt + ids])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(prompt) - 1 : -1]
        for t, token in enumerate(ids):  # each step's warpers see the sequence so far (these ignore it)
            processed = torch.log_softmax(warpers(seq[:, : len(prompt) + t], logits[t : t + 1].clone()), -1)[0]
            assert torch.isfinite(processed[token]), f"row {row} step {t}: token {token} is outside top-k/top-p"
            tol = _tol(model, logits / sampling.temperature)
            assert abs(float(processed[token]) - lps[t]) <= tol, (row, t, float(processed[token]), lps[t], tol)  # <= 1/60


def test_seeded_calls_repeat_and_unseeded_engine_calls_differ(model_dir):
    engine = HFEngine(model_dir, seed=7)
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=8)
    first, second = engine.generate(PROMPTS, sampling), engine.generate(PROMPTS, sampling)
    again = HFEngine(model_dir, seed=7).generate(PROMPTS, sampling)
    assert first.response_ids == again.response_ids and first.response_logprobs == again.response_logprobs
    assert first.response_ids != second.response_ids  # call k draws with seed + k


def test_rows_stop_at_their_first_stop_token(model_dir):
    engine = HFEngine(model_dir, dtype=torch.float64)
    engine.stop_ids = set()
    sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=12)
    full = engine.generate(PROMPTS, sampling)
    stop = full.response_ids[0][3]  # a token row 0 produces at step 3
    engine.stop_ids = {stop}
    out = engine.generate(PROMPTS, sampling)
    for row, ids in enumerate(full.response_ids):
        cut = ids.index(stop) + 1 if stop in ids else len(ids)
        assert out.response_ids[row] == ids[:cut]
        # exact: a stopped row stays in the batch (its later tokens are cut afterwards), so every step before
        # the cut runs the same forward over the same rows as without the stop
        assert out.response_logprobs[row] == full.response_logprobs[row][:cut]
        assert out.finish_reason[row] == ("stop" if stop in ids else "length")
    assert out.finish_reason[0] == "stop" and len(out.response_ids[0]) <= 4


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.5, 3, 1.0), (1.7, -1, 0.3),
                                                     (0.8, 50, 0.95), (1.0, 1, 1.0), (1.0, -1, 1e-6)])
def test_processed_logprobs_equal_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(16, 97, generator=torch.Generator().manual_seed(0)) * 3
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    expected = torch.log_softmax(reference_warpers(sampling)(torch.zeros(16, 1, dtype=torch.long), logits.clone()), -1)
    got = processed_logprobs(logits, sampling)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    # exact: both divide the same fp32 logits by the temperature, mask the same tokens (asserted above) to
    # -inf and take log_softmax of the same tensor
    assert torch.equal(got[finite], expected[finite])


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (3, 1.0), (-1, 0.7)])
def test_sampled_frequencies_match_the_processed_distribution(top_k, top_p):
    """200k draws from one row's distribution: each token's frequency within 5 standard errors of its
    probability, and never a token that top-k/top-p excludes."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    sampling = SamplingConfig(temperature=0.8, top_k=top_k, top_p=top_p)
    draws = 200_000
    torch.manual_seed(0)
    tokens, logprobs = sample_next(logits.expand(draws, -1), sampling)
    expected_logprobs = processed_logprobs(logits[None], sampling)[0]
    probs = expected_logprobs.exp().double()
    freq = torch.bincount(tokens, minlength=len(logits)).double() / draws
    assert torch.all(freq[probs == 0] == 0)
    bound = 5 * (probs * (1 - probs) / draws).sqrt()
    assert torch.all((freq - probs).abs() <= bound), (freq, probs)
    assert torch.equal(logprobs, expected_logprobs[tokens])
