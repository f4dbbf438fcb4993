"""Segment-wise generation for partial rollouts: generate at most `segment_tokens` new tokens per
sample, let the caller swap weights between segments, then continue the unfinished samples.

A continued request is the prompt plus the sample's tokens so far, with `max_tokens` = what is left of
its budget and one sample per request (n=1): the continuation is exactly what an engine does after
that prefix (vLLM's prefix cache makes the repeated prefill cheap on GPU); a prompt's images (the hf engine's
vision-language prompts) go with each of its continued requests, whose prefill then runs the same vision tower
on the same pixel values (rlsp.rollout.hf_vision_turns: only the prompt's image tokens are images). Greedy decoding with no
weight change therefore gives the tokens of one-shot generation; seeded sampling does not replay the
one-shot random stream (each segment's requests get their own seeds), it stays reproducible for the
same prompts, seeds and weight changes.

`on_boundary()` runs before every segment after the first and returns the policy version the engine
holds from then on (it may load newer weights); every token records the version that generated it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rlsp.rollout.base import RolloutEngine, RolloutOutput, SamplingConfig

# Far-apart seed offsets per segment, so the continuation requests of segment k never reuse the
# seeds of segment k - 1 (a request's samples use seed .. seed + requests - 1).
SEGMENT_SEED_STRIDE = 1_000_003


@dataclass
class SegmentedOutput:
    """The samples (as one-shot `generate` returns them) and, per sample, the version of every token."""

    out: RolloutOutput
    token_versions: list[list[int]] = field(default_factory=list)


def generate_in_segments(engine: RolloutEngine, prompt_ids: list[list[int]], sampling: SamplingConfig,
                         segment_tokens: int, version: int, on_boundary: Callable[[], int] | None = None,
                         images: Sequence[Any] | None = None) -> SegmentedOutput:
    """Sample `sampling.n` responses per prompt in segments of at most `segment_tokens` tokens, starting
    with the weights of `version`; `images`: each prompt's images (engines that take them), given again with
    every continued request of the prompt."""
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens={segment_tokens} must be >= 1")
    with_images = {} if images is None else {"images": images}
    first = engine.generate(prompt_ids, replace(sampling, max_tokens=min(segment_tokens, sampling.max_tokens)),
                            **with_images)
    ids, lps = list(first.response_ids), list(first.response_logprobs)
    finish, versions = list(first.finish_reason), [[version] * len(r) for r in first.response_ids]
    segment = 1
    while todo := [i for i, r in enumerate(ids) if finish[i] == "length" and len(r) < sampling.max_tokens]:
        version = on_boundary() if on_boundary is not None else version
        left = [sampling.max_tokens - len(ids[i]) for i in todo]
        # Requests that have the same budget left go together (max_tokens is per call).
        for budget in sorted(set(left)):
            group = [i for i, b in zip(todo, left) if b == budget]
            seed = None if sampling.seed is None else sampling.seed + segment * SEGMENT_SEED_STRIDE + group[0]
            step = replace(sampling, n=1, seed=seed, max_tokens=min(segment_tokens, budget))
            sources = [first.prompt_index[i] for i in group]
            more = engine.generate([prompt_ids[p] + ids[i] for p, i in zip(sources, group)], step,
                                   **({} if images is None else {"images": [images[p] for p in sources]}))
            for j, i in enumerate(group):
                ids[i] = ids[i] + more.response_ids[j]
                lps[i] = lps[i] + more.response_logprobs[j]
                versions[i] = versions[i] + [version] * len(more.response_ids[j])
                finish[i] = more.finish_reason[j]
        segment += 1
    out = RolloutOutput()
    for i in range(len(ids)):
        out.append(first.prompt_index[i], ids[i], lps[i], finish[i])
    return SegmentedOutput(out, versions)
