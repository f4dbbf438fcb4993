"""The rollout role's multi-turn path: run every sample of a prompt batch through its agent loop and turn the
trajectories into rollout rows.

Rows are the single-turn rows (prompt left-padded to P, response right-padded to R = data.max_response_length,
the whole trajectory) with `response_mask` 1 only on the policy's own tokens, `rollout_logprobs` 0 elsewhere,
and `step_rewards` [N, R] (tool step rewards at the last token of the turn that earned them). Per sample, meta
gains `agent_metrics` (turns, tool calls and errors, latency, truncation, and an even share of the worker's
engine busy/idle time) and `extra_info` gains what the loop reports for the reward function (num_turns,
finish_reason, and tool_agent's messages, tool_calls, tool_rewards).

Rows with images (a vision-language policy): each trajectory gets its prompt's `multi_modal_inputs`, every turn is
generated with them (rlsp.agent.server), and the rows keep them in meta for the trainer, whose image tokens are
those of the prompt (tool output and sampled tokens are text to the engine and the trainer alike).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlsp.agent.loop import AgentLoopOutput, AgentSample
from rlsp.agent.runner import AgentRunner
from rlsp.data.batch import Batch
from rlsp.models.vision_inputs import MM_KEY
from rlsp.rollout.base import RolloutEngine, SamplingConfig
from rlsp.workers.rollout_rows import build_rollout_rows


def _samples(prompts: Batch, n: int, max_tokens: int) -> tuple[list[AgentSample], list[str | None], list[int]]:
    meta = prompts.meta
    rows = len(meta["prompt_ids"])
    samples, names, source = [], [], []
    for i in range(rows):
        extra = dict(meta.get("extra_info", [None] * rows)[i] or {})
        messages = meta.get("messages", [None] * rows)[i]
        images = meta.get(MM_KEY, [None] * rows)[i]
        for _ in range(n):
            samples.append(AgentSample(list(meta["prompt_ids"][i]), messages, max_tokens,
                                       tools_kwargs=dict(extra.get("tools_kwargs") or {}), extra_info=extra,
                                       multi_modal_inputs=images))
            names.append(meta.get("agent_name", [None] * rows)[i])
            source.append(i)
    return samples, names, source


def _step_rewards(outs: list[AgentLoopOutput], width: int) -> torch.Tensor:
    rewards = torch.zeros((len(outs), width), dtype=torch.float32)
    for i, out in enumerate(outs):
        for position, reward in out.step_rewards:
            rewards[i, position] += float(reward)
    return rewards


def _sample_metrics(out: AgentLoopOutput, idle_share: float, busy_share: float) -> dict[str, float]:
    return {"agent/num_turns": float(out.num_turns), "agent/truncated": float(out.finish_reason == "length"),
            "agent/engine_idle_s": idle_share, "agent/engine_busy_s": busy_share, **out.metrics}


def agent_generate(runner: AgentRunner, engine: RolloutEngine, prompts: Batch, sampling: SamplingConfig,
                   widths: tuple[int, int], pad_id: int, version: int,
                   on_boundary: Callable[[], int] | None) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
    """Rows and per-sample meta of `sampling.n` trajectories per prompt (rows of one prompt contiguous)."""
    P, R = widths
    samples, names, source = _samples(prompts, sampling.n, sampling.max_tokens)
    outs, stats = runner.run(engine, samples, names, sampling, version, on_boundary)
    for out, name in zip(outs, names):
        out.check(name or runner.default_loop, P, R)
    rows = build_rollout_rows(
        [o.prompt_ids for o in outs], [o.response_ids for o in outs], [o.response_logprobs for o in outs], P, R,
        pad_id, [o.token_versions or [version] * len(o.response_ids) for o in outs], version,
        response_masks=[o.response_mask for o in outs],
    )
    rows["step_rewards"] = _step_rewards(outs, R)
    share = 1.0 / max(len(outs), 1)
    meta = {k: [v[i] for i in source] for k, v in prompts.meta.items() if k != "prompt_ids"}
    extras = meta.get("extra_info", [None] * len(outs))
    meta["extra_info"] = [{**(extra or {}), **out.extra, "num_turns": out.num_turns,
                           "finish_reason": out.finish_reason} for extra, out in zip(extras, outs)]
    meta["agent_metrics"] = [_sample_metrics(o, stats.idle_s * share, stats.busy_s * share) for o in outs]
    return rows, meta
