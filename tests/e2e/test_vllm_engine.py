"""vLLM and HF rollout engines against an fp64 transformers reference on the tiny model.

One vLLM engine is built per module. `current` holds the HF model whose weights the engine holds
at any time, so every test compares against the right reference whatever the test order.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from tolerances import logprob_tol
from transformers import AutoConfig, AutoModelForCausalLM

from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.rollout import RolloutEngine, SamplingConfig, build_rollout_engine

pytestmark = pytest.mark.e2e

# "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n7<|im_end|>" as char-token ids.
SEQUENCE = [2, 37, 35, 21, 34, 5, 10, 43, 11, 46, 3, 5, 2, 17, 35, 35, 25, 35, 36, 17, 30, 36, 5, 12, 3]
PROMPTS = [SEQUENCE[:23], SEQUENCE[2:23], [2, 37, 35, 21, 34, 5, 8, 43, 12, 46, 3, 5, 2, 17, 35, 35, 25, 35, 36, 17, 30, 36, 5, 5]]
# Longer than one CPU KV block (128 tokens), so vLLM's prefix cache actually holds blocks of it.
LONG_PROMPTS = [SEQUENCE[:6] + [6 + i % 40 for i in range(150)] + SEQUENCE[10:23]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(TinyModelSpec(), str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def tol(model_path: str) -> float:
    """An fp32 engine's logprobs against the fp64 reference: within the bound of two fp32 forwards of the
    model (tests/tolerances.py `logprob_tol`; the fp64 side carries ~none) over the engines' max_model_len."""
    return logprob_tol(AutoConfig.from_pretrained(model_path), 256)


@pytest.fixture(scope="module")
def current(model_path: str) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    return {"model": model}


@pytest.fixture(scope="module")
def vllm_engine(model_path: str) -> RolloutEngine:
    pytest.importorskip("vllm")
    t0 = time.perf_counter()
    engine = build_rollout_engine("vllm", model_path, dtype="float32", max_model_len=256, seed=0)
    print(f"\nvLLM engine build: {time.perf_counter() - t0:.1f}s")
    return engine


def reference_logprobs(model: torch.nn.Module, token_ids: list[int], temperature: float = 1.0) -> list[float]:
    """fp64 log p(token_t | tokens_<t) for t >= 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].double() / temperature
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(-1, torch.tensor(token_ids[1:])[:, None]).squeeze(-1).tolist()


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def sample_logprob_diff(
    engine: RolloutEngine, model: torch.nn.Module, sampling: SamplingConfig, prompts: list[list[int]] = PROMPTS
) -> float:
    """Generate, check the grouping, and return the max |engine - reference| over all sampled tokens."""
    out = engine.generate(prompts, sampling)
    assert out.prompt_index == [i for i in range(len(prompts)) for _ in range(sampling.n)]
    worst = 0.0
    for prompt_index, ids, logprobs, finish in zip(out.prompt_index, out.response_ids, out.response_logprobs, out.finish_reason):
        prompt = prompts[prompt_index]
        assert 1 <= len(ids) <= sampling.max_tokens and len(logprobs) == len(ids)
        assert finish == ("stop" if ids[-1] in (1, 3) else "length")
        assert all(tok not in (1, 3) for tok in ids[:-1])  # generation ends at the first stop id
        ref = reference_logprobs(model, prompt + ids, sampling.temperature)[len(prompt) - 1 :]
        worst = max(worst, max_diff(ref, logprobs))
    return worst


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * scale)


def send_weights(engine: RolloutEngine, model: torch.nn.Module) -> None:
    # named_parameters lists the tied embedding once (no lm_head.weight), as a trainer would send it.
    engine.update_weights((name, p.detach().to(torch.float32).clone()) for name, p in model.named_parameters())


def test_prompt_logprobs_match_transformers(vllm_engine: RolloutEngine, current: dict, tol: float) -> None:
    got = vllm_engine.prompt_logprobs(SEQUENCE)
    assert got[0] is None and len(got) == len(SEQUENCE)
    diff = max_diff(reference_logprobs(current["model"], SEQUENCE), got[1:])
    print(f"\nvLLM prompt_logprobs vs fp64 HF: max diff {diff:.2e}")
    assert diff <= tol


def test_weight_sync_reaches_vllm(vllm_engine: RolloutEngine, current: dict, tol: float) -> None:
    model = current["model"]
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=6, seed=11)
    vllm_engine.generate(LONG_PROMPTS, sampling)  # fills the prefix cache with the old weights' KV
    old = reference_logprobs(model, SEQUENCE)
    perturb_(model, seed=1)
    new = reference_logprobs(model, SEQUENCE)
    assert max_diff(old, new) > 0.05  # the perturbation is visible: the check below has teeth
    send_weights(vllm_engine, model)
    got = vllm_engine.prompt_logprobs(SEQUENCE)[1:]
    diff_new, diff_old = max_diff(new, got), max_diff(old, got)
    print(f"\nafter sync: max diff vs perturbed {diff_new:.2e}, vs old {diff_old:.2e}")
    assert diff_new <= tol and diff_old > 0.05
    # Sampling after the sync must use the new weights too (no stale prefix-cache KV).
    assert sample_logprob_diff(vllm_engine, model, sampling, LONG_PROMPTS) <= tol


def test_generate_logprobs_match_recomputation(vllm_engine: RolloutEngine, current: dict, tol: float) -> None:
    sampling = SamplingConfig(n=5, temperature=1.0, max_tokens=8, seed=3)
    diff = sample_logprob_diff(vllm_engine, current["model"], sampling)
    print(f"\nvLLM sampled-token logprobs vs fp64 HF (T=1): max diff {diff:.2e}")
    assert diff <= tol
    warm = SamplingConfig(n=3, temperature=0.7, max_tokens=8, seed=4)
    assert sample_logprob_diff(vllm_engine, current["model"], warm) <= tol


def test_seeded_generation_repeats_and_greedy_is_argmax(vllm_engine: RolloutEngine, current: dict) -> None:
    sampling = SamplingConfig(n=4, max_tokens=8, seed=21)
    first, second = vllm_engine.generate(PROMPTS, sampling), vllm_engine.generate(PROMPTS, sampling)
    assert first.response_ids == second.response_ids
    assert len({tuple(ids) for ids in first.response_ids}) > 1  # samples of a prompt differ
    greedy = vllm_engine.generate(PROMPTS[:1], sampling.greedy())
    ids = greedy.response_ids[0]
    with torch.no_grad():
        logits = current["model"](torch.tensor([PROMPTS[0] + ids])).logits[0]
    assert ids == logits[len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist()[: len(ids)]


def test_seeded_batch_beyond_one_scheduler_step(vllm_engine: RolloutEngine, tol: float) -> None:
    # 16 prompts x 8 samples x 40 prompt tokens is more than vLLM schedules in one step: with chunked
    # prefill one prompt was split over two steps and vLLM-CPU crashed rewinding its seeded generator
    # ("CPU Generator does not use offset"). The samples must equal those of two batches that fit a step.
    prompts = [[2] + [6 + (7 * i + j) % 40 for j in range(39)] for i in range(16)]
    budget = vllm_engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert 16 * 8 * 40 > budget
    sampling = SamplingConfig(n=8, temperature=1.0, max_tokens=6, seed=5)
    whole = vllm_engine.generate(prompts, sampling)
    # The second half's seeds continue the first's: sample j of prompt i has seed + i * n + j either way.
    halves = [vllm_engine.generate(prompts[:8], sampling),
              vllm_engine.generate(prompts[8:], dataclasses.replace(sampling, seed=5 + 8 * 8))]
    assert 8 * 8 * 40 <= budget
    assert len(whole) == 128 and whole.response_ids == halves[0].response_ids + halves[1].response_ids
    pairs = zip(whole.response_logprobs, halves[0].response_logprobs + halves[1].response_logprobs)
    # the same engine over other batches: its kernels block the batch otherwise, two fp32 forwards
    worst = max(abs(a - b) for x, y in pairs for a, b in zip(x, y))
    assert worst <= tol, (worst, tol)


def test_hf_engine_same_protocol(model_path: str, tol: float) -> None:
    # The keyword set a policy worker passes to either engine.
    engine = build_rollout_engine("hf", model_path, dtype="float32", seed=7, max_model_len=128, device="cpu")
    twin = build_rollout_engine("hf", model_path, dtype="float32", seed=7, max_model_len=128, device="cpu")
    assert isinstance(engine, RolloutEngine)
    unseeded = SamplingConfig(n=4, max_tokens=8)
    assert engine.generate(PROMPTS, unseeded).response_ids == twin.generate(PROMPTS, unseeded).response_ids
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    assert max_diff(reference_logprobs(reference, SEQUENCE), engine.prompt_logprobs(SEQUENCE)[1:]) <= tol
    # Prompts of different lengths exercise left padding.
    assert sample_logprob_diff(engine, reference, SamplingConfig(n=3, temperature=0.8, max_tokens=6, seed=5)) <= tol
    perturb_(reference, seed=2)
    send_weights(engine, reference)
    assert max_diff(reference_logprobs(reference, SEQUENCE), engine.prompt_logprobs(SEQUENCE)[1:]) <= tol
    with pytest.raises(ValueError, match="unknown parameter 'model.nope'"):
        engine.update_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="exceeds max_model_len=128"):
        engine.generate(LONG_PROMPTS, unseeded)
