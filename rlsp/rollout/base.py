"""Rollout engine protocol, sampling settings and the rollout output container.

A rollout engine turns token-id prompts into sampled responses with the logprob of every sampled
token, accepts new policy weights in place, and scores fixed sequences (prompt logprobs) so that
weight synchronisation can be verified. Two implementations live next to this file: vLLM
(`vllm_engine.py`, the only module importing vllm) and the transformers model with rlsp's decoding loop (`hf_engine.py`).

Logprob convention: `response_logprobs` are logprobs under the distribution the token was sampled
from, i.e. `log_softmax(logits / temperature)` restricted and renormalised by top-k/top-p. With
top_k=-1 and top_p=1 this equals what a trainer computes from `logits / temperature`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from rlsp.config.choices import ROLLOUT_ENGINES

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample: `n` samples per prompt, at most `max_tokens` new tokens each.

    temperature=0 means greedy decoding; top_k=-1 disables top-k; seed=None draws fresh randomness.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 32
    seed: int | None = None
    ignore_eos: bool = False  # keep generating after EOS up to max_tokens (fixed-length benchmarks)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n={self.n}: need at least one sample per prompt")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k}: must be -1 (disabled) or >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 1")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def greedy(self) -> SamplingConfig:
        """Same limits, one greedy (argmax) sample per prompt: for validation."""
        return replace(self, n=1, temperature=0.0, top_p=1.0, top_k=-1)


@dataclass
class RolloutOutput:
    """Samples of one `generate` call, flat and grouped: all samples of prompt i are contiguous
    and prompts appear in input order, so sample j of prompt i is at `i * n + j`."""

    prompt_index: list[int] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    response_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.response_ids)

    def append(self, prompt_index: int, ids: list[int], logprobs: list[float], finish: str) -> None:
        if len(ids) != len(logprobs):
            raise RuntimeError(f"sample of prompt {prompt_index}: {len(ids)} tokens but {len(logprobs)} logprobs")
        if finish not in FINISH_REASONS:
            raise RuntimeError(f"finish_reason={finish!r}; expected one of {FINISH_REASONS}")
        self.prompt_index.append(prompt_index)
        self.response_ids.append(ids)
        self.response_logprobs.append(logprobs)
        self.finish_reason.append(finish)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the policy worker needs from an inference engine."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> RolloutOutput: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def prompt_logprobs(self, token_ids: list[int]) -> list[float | None]: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


ENGINE_NAMES = ROLLOUT_ENGINES  # the legal actor_rollout_ref.rollout.name values, defined once in rlsp.config


def build_rollout_engine(name: str, model_path: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine called `name` ("vllm" or "hf"); vllm is imported only when asked for."""
    if name == "vllm":
        from rlsp.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **kwargs)
    if name == "hf":
        from rlsp.rollout.hf_engine import HFEngine

        return HFEngine(model_path, **kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {ENGINE_NAMES}")
