"""Rollout protocol pieces that need no engine: sampling validation, output grouping, lazy vllm import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlsp.rollout import RolloutOutput, SamplingConfig, build_rollout_engine


def test_sampling_config_defaults_and_greedy() -> None:
    cfg = SamplingConfig(n=8, temperature=0.7, top_p=0.9, top_k=5, max_tokens=16, seed=3)
    greedy = cfg.greedy()
    assert (greedy.n, greedy.temperature, greedy.top_p, greedy.top_k) == (1, 0.0, 1.0, -1)
    assert (greedy.max_tokens, greedy.seed) == (16, 3) and greedy.is_greedy and not cfg.is_greedy
    assert SamplingConfig() == SamplingConfig(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=32, seed=None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"n": 0}, "n=0"), ({"temperature": -1.0}, "temperature=-1.0"), ({"top_p": 0.0}, "top_p=0.0"),
     ({"top_k": 0}, "top_k=0"), ({"max_tokens": 0}, "max_tokens=0")],
)
def test_sampling_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_rollout_output_append_checks() -> None:
    out = RolloutOutput()
    out.append(0, [5, 3], [-0.1, -0.2], "stop")
    out.append(0, [7], [-1.0], "length")
    assert len(out) == 2 and out.prompt_index == [0, 0] and out.finish_reason == ["stop", "length"]
    with pytest.raises(RuntimeError, match="2 tokens but 1 logprobs"):
        out.append(1, [1, 2], [-0.5], "stop")
    with pytest.raises(RuntimeError, match="finish_reason='abort'"):
        out.append(1, [1], [-0.5], "abort")


def test_unknown_engine_name_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown rollout engine 'sglang'; choose one of \('vllm', 'hf'\)"):
        build_rollout_engine("sglang", "/nonexistent")


def test_importing_rollout_does_not_import_vllm() -> None:
    code = "import sys, rlsp.rollout, rlsp.rollout.hf_engine; print('vllm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
