"""Segment-wise generation (partial rollouts, rlsp/rollout/segments.py) on the engines, tiny model, CPU:

* greedy, no weight change: the segments give exactly the tokens of one-shot generation, and the
  logprobs to fp32 tolerance (vLLM in-process and HF generate);
* new weights at the first segment boundary: the tokens after it are what an engine freshly built
  from the new weights generates greedily from prompt + first segment, and carry the new version.
"""

from __future__ import annotations

import time

import pytest
import torch
from tolerances import logprob_tol
from transformers import AutoConfig, AutoModelForCausalLM

from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.rollout import RolloutEngine, SamplingConfig, build_rollout_engine
from rlsp.rollout.segments import generate_in_segments

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 128  # the engines': an upper bound on a sequence's token reductions
SEQUENCE = [2, 37, 35, 21, 34, 5, 10, 43, 11, 46, 3, 5, 2, 17, 35, 35, 25, 35, 36, 17, 30, 36, 5, 12, 3]
PROMPTS = [SEQUENCE[:23], SEQUENCE[2:23], SEQUENCE[4:20], [2, 37, 35, 21, 34, 5, 8, 43, 12, 46, 3, 5, 2, 17]]
GREEDY = SamplingConfig(n=1, temperature=0.0, max_tokens=12)
SEGMENT = 5  # boundaries after 5 and 10 tokens; the last segment has 2 left


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(TinyModelSpec(), str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    """A perturbed copy of the model: its directory and its named tensors (as a trainer would send them)."""
    path = build_tiny_model(TinyModelSpec(), str(tmp_path_factory.mktemp("tiny_new") / "model"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.2)
    model.save_pretrained(path)  # the weights only: the tokenizer files stay
    return path, [(n, p.detach().clone()) for n, p in model.named_parameters()]


@pytest.fixture(scope="module", params=["vllm", "hf"])
def engine(request: pytest.FixtureRequest, model_path: str) -> RolloutEngine:
    """One engine of each kind per module, holding model_path's weights at the start of every test."""
    if request.param == "vllm":
        pytest.importorskip("vllm")
    t0 = time.perf_counter()
    built = build_rollout_engine(request.param, model_path, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0)
    print(f"\n{request.param} engine build: {time.perf_counter() - t0:.1f}s")
    built.name = request.param
    return built


def _tol(model_path: str) -> float:
    """One-shot decode against a re-prefilled continuation, both fp32: two kernels of one model (a cached
    decode against a prefill), tests/tolerances.py's `logprob_tol`."""
    return logprob_tol(AutoConfig.from_pretrained(model_path), MAX_MODEL_LEN)


def test_greedy_segments_equal_one_shot(engine: RolloutEngine, model_path: str) -> None:
    whole = engine.generate(PROMPTS, GREEDY)
    parts = generate_in_segments(engine, PROMPTS, GREEDY, SEGMENT, version=0, on_boundary=lambda: 0)
    lengths = [len(r) for r in whole.response_ids]
    assert max(lengths) > SEGMENT, f"no response crosses a segment boundary ({lengths}): the test has no teeth"
    assert parts.out.response_ids == whole.response_ids
    assert parts.out.finish_reason == whole.finish_reason and parts.out.prompt_index == whole.prompt_index
    worst = max(max((abs(a - b) for a, b in zip(x, y)), default=0.0)
                for x, y in zip(parts.out.response_logprobs, whole.response_logprobs))
    print(f"\n{engine.name}: response lengths {lengths}, max |logprob diff| segments vs one-shot {worst:.2e}")
    assert worst <= _tol(model_path), worst
    assert parts.token_versions == [[0] * n for n in lengths]


def test_new_weights_at_a_boundary_continue_the_samples(engine: RolloutEngine, model_path: str, new_weights) -> None:
    new_path, named = new_weights
    old = engine.generate(PROMPTS, GREEDY)
    swaps: list[int] = []

    def swap() -> int:  # the new weights arrive at the first boundary
        if not swaps:
            engine.update_weights(named)
        swaps.append(1)
        return 1

    try:
        parts = generate_in_segments(engine, PROMPTS, GREEDY, SEGMENT, version=0, on_boundary=swap)
    finally:
        original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        engine.update_weights([(n, p.detach().clone()) for n, p in original.named_parameters()])
    fresh = build_rollout_engine("hf", new_path, dtype="float32", max_model_len=128)  # built from the new weights
    continued = 0
    for i, ids in enumerate(parts.out.response_ids):
        head = old.response_ids[i][:SEGMENT]
        assert ids[: len(head)] == head  # the first segment came from the old weights
        assert parts.token_versions[i] == [0] * len(head) + [1] * (len(ids) - len(head))
        if len(head) < SEGMENT or old.finish_reason[i] == "stop" and len(old.response_ids[i]) == SEGMENT:
            assert ids == head  # finished within the first segment
            continue
        continued += 1
        rest = SamplingConfig(n=1, temperature=0.0, max_tokens=GREEDY.max_tokens - len(head))
        expected = fresh.generate([PROMPTS[i] + head], rest)
        assert ids[len(head):] == expected.response_ids[0], (i, ids, head, expected.response_ids[0])
        worst = max(abs(a - b) for a, b in zip(parts.out.response_logprobs[i][len(head):], expected.response_logprobs[0]))
        assert worst <= _tol(model_path), worst
    print(f"\n{engine.name}: {continued} of {len(PROMPTS)} samples continued with the new weights")
    assert continued >= 1, "no sample reached a segment boundary"
    assert parts.out.response_ids != old.response_ids  # the new weights changed what was generated
