"""`tool_agent`: the policy writes, calls tools, reads their results and writes again, for several turns.

Each turn: the engine continues the trajectory's ids (never re-rendered from text); the turn's text is
parsed for tool calls (`multi_turn.format`); the calls run concurrently in the trajectory's tool session
(state kept for the whole trajectory, each call bounded in time and output); their results enter as the
observation ids the chat template renders after an assistant turn (mask 0), ending with the next
assistant prompt. The trajectory ends when a turn makes no tool call, ends without the template's
end-of-turn token, reaches a turn limit, or the budget (`data.max_response_length`, all turns and tool
output together) runs out (`finish_reason="length"`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rlsp.agent.formats import stop_token_ids
from rlsp.agent.loop import AgentLoop, AgentLoopOutput, AgentSample, register_agent_loop
from rlsp.agent.parsing import parse_tool_calls
from rlsp.agent.server import Generation
from rlsp.agent.tools.session import ToolResult, ToolSession
from rlsp.agent.types import ToolCall


@dataclass
class _Trajectory:
    prompt_ids: list[int]
    budget: int
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    version: int = 0

    def left(self) -> int:
        return self.budget - len(self.ids)

    def add_policy(self, gen: Generation) -> None:
        self.ids += gen.ids
        self.mask += [1] * len(gen.ids)
        self.logprobs += gen.logprobs
        self.versions += [gen.version] * len(gen.ids)
        self.version = gen.version

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.version] * len(ids)


@dataclass
class _Log:
    """What the reward function and the metrics see of one trajectory."""

    messages: list[dict[str, Any]]
    calls: list[dict[str, Any]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    step_rewards: list[tuple[int, float]] = field(default_factory=list)
    assistant_turns: int = 0
    tool_turns: int = 0
    parse_errors: int = 0


def _assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message


def _call_entry(call: ToolCall) -> dict[str, Any]:
    """A call as a chat template's `tool_calls` entry (a call that could not be read renders as `{}`)."""
    return {"type": "function", "function": {"name": call.name or "unknown", "arguments": call.arguments or {}}}


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoop):
    def __init__(self, env: Any) -> None:
        super().__init__(env)
        self._stop_ids = stop_token_ids(env.settings.format, env.tokenizer)

    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        s = self.env.settings
        session = ToolSession(self.env.tools, sample.tools_kwargs, timeout_s=s.tool_timeout_s,
                              max_response_chars=s.max_tool_response_length,
                              truncate_side=s.tool_response_truncate_side, max_parallel_calls=s.max_parallel_calls)
        traj = _Trajectory(list(sample.prompt_ids), sample.max_response_tokens)
        log = _Log(messages=[dict(m) for m in (sample.messages or [])])
        final = 0.0
        try:
            finish = await self._turns(traj, log, session)
        finally:
            final = await session.close()  # each tool instance's calc_reward, then release
        if final and 1 in traj.mask:  # the tools' final rewards join the last policy token's step reward
            log.step_rewards.append((len(traj.mask) - 1 - traj.mask[::-1].index(1), final))
            log.turn_rewards.append(final)
        return self._output(traj, log, session, finish)

    async def _turns(self, traj: _Trajectory, log: _Log, session: ToolSession) -> str:
        s, server = self.env.settings, self.env.server
        while (left := traj.left()) > 0:
            gen = self._at_stop(await server.generate(
                traj.prompt_ids + traj.ids, min(left, s.max_tokens_per_turn) if s.max_tokens_per_turn else left))
            traj.add_policy(gen)
            log.assistant_turns += 1
            ended = bool(gen.ids) and gen.ids[-1] in self.env.chat.end_of_turn_ids() | self._stops()
            content, calls = parse_tool_calls(self._text(gen.ids), s.format,
                                              [tool.tool_schema for tool in self.env.tools.values()])
            log.messages.append(_assistant_message(content, calls))
            log.parse_errors += sum(c.error is not None for c in calls)
            if gen.finish_reason != "stop":
                return "length"
            if not ended or not calls or self._at_turn_limit(log):
                return "stop"
            async with server.tool_call():
                results = await session.call(calls)
            self._record(traj, log, calls, results)
            # The template renders the results after this turn's calls and the token it ended with.
            observation = self.env.chat.observation_ids(
                log.messages[-len(results):], [_call_entry(c) for c in calls], end_id=gen.ids[-1])
            if len(observation) > traj.left():
                traj.add_observation(observation[: traj.left()])
                return "length"
            traj.add_observation(observation)
            log.tool_turns += 1
        return "length"

    def _stops(self) -> set[int]:
        """The format's stop tokens (gpt-oss's <|call|>, ...): they end a turn like the end-of-turn token."""
        return self._stop_ids

    def _at_stop(self, gen: Generation) -> Generation:
        """`gen` cut right after its first stop token: what the engine returns when it stops there (the
        kept tokens and their logprobs do not depend on what was sampled after them)."""
        stops = self._stops()
        cut = next((i + 1 for i, tok in enumerate(gen.ids) if tok in stops), len(gen.ids))
        if cut == len(gen.ids):
            return gen
        return replace(gen, ids=gen.ids[:cut], logprobs=gen.logprobs[:cut], finish_reason="stop")

    def _text(self, ids: list[int]) -> str:
        # Special tokens other than the end-of-turn stay: some formats use added tokens as call markers
        # (and a format's stop token, e.g. gpt-oss's <|call|>, tells a finished call from a cut-off one).
        ended = bool(ids) and ids[-1] in self.env.chat.end_of_turn_ids()
        return self.env.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)

    def _at_turn_limit(self, log: _Log) -> bool:
        s = self.env.settings
        return ((s.max_assistant_turns is not None and log.assistant_turns >= s.max_assistant_turns)
                or (s.max_user_turns is not None and log.tool_turns >= s.max_user_turns))

    @staticmethod
    def _record(traj: _Trajectory, log: _Log, calls: list[ToolCall], results: list[ToolResult]) -> None:
        reward = float(sum(r.reward for r in results))
        log.turn_rewards.append(reward)
        log.step_rewards.append((len(traj.ids) - 1, reward))
        for call, result in zip(calls, results):
            log.calls.append({"name": call.name, "arguments": call.arguments, "response": result.text,
                              "error": result.error, "reward": result.reward})
            log.messages.append({"role": "tool", "name": result.name, "content": result.text})

    def _output(self, traj: _Trajectory, log: _Log, session: ToolSession, finish: str) -> AgentLoopOutput:
        counts = session.counts
        errors = sum(v for k, v in counts.items() if k.startswith("errors/"))
        # Error kinds only where they happened: a trajectory without them counts 0 in the batch means.
        metrics = {"agent/tool_errors": float(errors), "agent/assistant_turns": float(log.assistant_turns),
                   "agent/tool_turns": float(log.tool_turns), "agent/parse_errors": float(log.parse_errors),
                   **{f"agent/tool_{k}": float(v) for k, v in counts.items()
                      if v or not (k.startswith("errors/") or k == "release_errors")}}
        extra = {"num_turns": log.assistant_turns, "messages": log.messages, "tool_calls": log.calls,
                 "tool_rewards": log.turn_rewards}
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids, response_ids=traj.ids, response_mask=traj.mask,
            response_logprobs=traj.logprobs, num_turns=log.assistant_turns, finish_reason=finish,
            token_versions=traj.versions, step_rewards=log.step_rewards, metrics=metrics, extra=extra,
        )
