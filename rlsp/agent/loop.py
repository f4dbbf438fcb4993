"""The agent-loop API: what a loop gets (`AgentSample`, `AgentEnv`), what it returns (`AgentLoopOutput`), the
registry of loops by name, and the built-in `single_turn_agent`.

A loop is a class with an async `run(sample) -> AgentLoopOutput`; it asks the engine for continuations
with `await self.env.server.generate(ids, max_tokens)` and builds the trajectory's ids itself, turn by
turn: what the policy generated goes in with mask 1 and its logprobs, everything else (tool output,
template tokens, a simulated user) with mask 0. Register a loop with `@register_agent_loop("name")`, or
list it in the YAML file of `actor_rollout_ref.rollout.agent.agent_loop_config_path`
(`- name: my_agent` / `_target_: my_pkg.my_module.MyLoop`); data rows choose a loop by `agent_name`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlsp.agent.server import GenerationServer
from rlsp.agent.tools.base import BaseTool

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class AgentSettings:
    """actor_rollout_ref.rollout.multi_turn.* as plain values (docs/agents.md)."""

    max_assistant_turns: int | None = None  # None: until the model stops calling tools or the budget ends
    max_user_turns: int | None = None  # observation (tool/user) turns
    max_parallel_calls: int = 1  # tool calls executed per assistant turn
    max_tool_response_length: int = 256  # characters of one tool response
    tool_response_truncate_side: str = "middle"
    tool_timeout_s: float = 30.0
    max_tokens_per_turn: int | None = None  # None: each turn may use what is left of the trajectory budget
    format: str = "hermes"
    use_step_rewards: bool = False


@dataclass
class AgentEnv:
    """What every loop of a worker shares: the engine server, the tokenizer, the tools and the settings."""

    server: GenerationServer
    tokenizer: Any
    tools: dict[str, BaseTool]
    settings: AgentSettings
    chat: Any = None  # rlsp.agent.chat.ChatTokens over the tokenizer and the tools' schemas


@dataclass
class AgentSample:
    """One trajectory to run: the row's rendered prompt and chat messages, and its limits."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]] | None
    max_response_tokens: int  # the whole trajectory after the prompt: every turn, tool output included
    tools_kwargs: dict[str, Any] = field(default_factory=dict)  # extra_info.tools_kwargs (verl's shape)
    extra_info: dict[str, Any] = field(default_factory=dict)
    # The prompt's images (a vision-language row's pixel values and grids; None: text): every continuation the
    # loop asks for is generated with them (rlsp.agent.server.TRAJECTORY_IMAGES), the trainer reads them with the row.
    multi_modal_inputs: dict[str, Any] | None = None


@dataclass
class AgentLoopOutput:
    """One trajectory. `response_mask` is 1 exactly on the policy's own tokens; `response_logprobs` holds
    the engine's logprob of each of them (0 elsewhere); `step_rewards` are (response position, reward)
    pairs, the position being the last policy token of the turn that earned it."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    num_turns: int
    finish_reason: str = "stop"
    token_versions: list[int] = field(default_factory=list)  # policy version per response token
    step_rewards: list[tuple[int, float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # given to the reward function under extra_info

    def check(self, loop_name: str, max_prompt: int, max_response: int) -> None:
        """Refuse an output whose parts disagree (a user loop's mistake, named)."""
        n = len(self.response_ids)
        where = f"agent loop {loop_name!r}"
        for name, seq in (("response_mask", self.response_mask), ("response_logprobs", self.response_logprobs)):
            if len(seq) != n:
                raise RuntimeError(f"{where} returned {len(seq)} {name} entries for {n} response tokens")
        if self.token_versions and len(self.token_versions) != n:
            raise RuntimeError(f"{where} returned {len(self.token_versions)} token versions for {n} response tokens")
        if not self.prompt_ids or len(self.prompt_ids) > max_prompt:
            raise RuntimeError(f"{where} returned a prompt of {len(self.prompt_ids)} tokens; legal: 1..{max_prompt} "
                               "(data.max_prompt_length)")
        if n > max_response:
            raise RuntimeError(f"{where} returned {n} response tokens > data.max_response_length={max_response} "
                               "(the bound on the whole trajectory)")
        if any(m not in (0, 1) for m in self.response_mask):
            raise RuntimeError(f"{where} returned a response_mask with values other than 0 and 1")
        if self.finish_reason not in FINISH_REASONS:
            raise RuntimeError(f"{where} returned finish_reason={self.finish_reason!r}; legal: {FINISH_REASONS}")
        for position, _ in self.step_rewards:
            if not 0 <= position < n:
                raise RuntimeError(f"{where} placed a step reward at position {position} of {n} response tokens")


class AgentLoop:
    """Base class of agent loops: subclass, implement `run`, register under a name."""

    def __init__(self, env: AgentEnv) -> None:
        self.env = env

    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        raise NotImplementedError


_REGISTRY: dict[str, type[AgentLoop]] = {}


def register_agent_loop(name: str) -> Callable[[type[AgentLoop]], type[AgentLoop]]:
    def add(cls: type[AgentLoop]) -> type[AgentLoop]:
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise TypeError(f"register_agent_loop({name!r}) needs an AgentLoop subclass, got {cls!r}")
        if _REGISTRY.get(name, cls) is not cls:
            raise ValueError(f"agent loop name {name!r} is taken by {_REGISTRY[name].__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return add


def agent_loop_class(name: str) -> type[AgentLoop]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown agent loop {name!r}; registered: {sorted(_REGISTRY)} (more through "
                         "actor_rollout_ref.rollout.agent.agent_loop_config_path)")
    return _REGISTRY[name]


def registered_agent_loops() -> list[str]:
    return sorted(_REGISTRY)


@register_agent_loop("single_turn_agent")
class SingleTurnAgentLoop(AgentLoop):
    """One continuation of the prompt: the single-turn rollout, inside the agent machinery."""

    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        limit = sample.max_response_tokens
        cap = self.env.settings.max_tokens_per_turn
        gen = await self.env.server.generate(sample.prompt_ids, min(limit, cap) if cap else limit)
        return AgentLoopOutput(
            prompt_ids=list(sample.prompt_ids), response_ids=list(gen.ids), response_mask=[1] * len(gen.ids),
            response_logprobs=list(gen.logprobs), num_turns=1, finish_reason=gen.finish_reason,
            token_versions=[gen.version] * len(gen.ids),
        )
