"""Start-up check of multi-turn rollouts (`actor_rollout_ref.rollout.multi_turn.*`, `.agent.*`): values only.

Agent loops run when `multi_turn.enable=true`, or when a verl command picks a loop without it
(`agent.default_agent_loop` other than single_turn_agent, or `agent.agent_loop_config_path` set), as
verl's agent-loop rollouts do. Files (tool YAML, function tools, loop YAML) are loaded by the trainer's
preflight, which can import them; here only values and combinations are checked.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.choices import TOOL_CALL_FORMATS, TRUNCATE_SIDES, choice_error
from rlsp.config.run_spec import agent_loops_enabled

MT = "actor_rollout_ref.rollout.multi_turn."
AGENT = "actor_rollout_ref.rollout.agent."
SANITY_MODES = ("strict", "ignore_strippable", "disable")


def _positive(key: str, value: Any, errors: list[str], *, optional: bool = False, real: bool = False) -> None:
    if optional and value is None:
        return
    kinds = (int, float) if real else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        legal = "a positive number" if real else "an integer >= 1"
        errors.append(f"{key}={value!r} must be {legal}{' or null (no limit)' if optional else ''}")


def _check_values(cfg: Any, errors: list[str]) -> None:
    mt, agent = cfg.actor_rollout_ref.rollout.multi_turn, cfg.actor_rollout_ref.rollout.agent
    for key, value, legal in ((MT + "format", mt.format, TOOL_CALL_FORMATS),
                              (MT + "tool_response_truncate_side", mt.tool_response_truncate_side, TRUNCATE_SIDES),
                              (MT + "tokenization_sanity_check_mode", mt.tokenization_sanity_check_mode, SANITY_MODES)):
        if (error := choice_error(key, value, legal)) is not None:
            errors.append(error)
    for name in ("max_assistant_turns", "max_user_turns", "max_tokens_per_turn"):
        _positive(MT + name, mt[name], errors, optional=True)
    for name in ("max_parallel_calls", "max_tool_response_length"):
        _positive(MT + name, mt[name], errors)
    _positive(MT + "tool_timeout_s", mt.tool_timeout_s, errors, real=True)
    _positive(AGENT + "num_workers", agent.num_workers, errors)
    if not isinstance(agent.default_agent_loop, str) or not agent.default_agent_loop:
        errors.append(f"{AGENT}default_agent_loop={agent.default_agent_loop!r} must name an agent loop "
                      "(single_turn_agent, tool_agent, or one registered by agent.agent_loop_config_path)")
    cap, budget = mt.max_tokens_per_turn, cfg.data.max_response_length
    if isinstance(cap, int) and cap > budget:
        errors.append(f"{MT}max_tokens_per_turn={cap} exceeds data.max_response_length={budget}, the bound on "
                      "the whole trajectory; legal: 1..data.max_response_length or null")


def _check_refused(cfg: Any, errors: list[str]) -> None:
    mt, agent = cfg.actor_rollout_ref.rollout.multi_turn, cfg.actor_rollout_ref.rollout.agent
    if mt.interaction_config_path is not None:
        errors.append(f"{MT}interaction_config_path={mt.interaction_config_path!r} is not supported: rlsp has no "
                      "interaction classes; write a simulated user as an agent loop (agent.agent_loop_config_path, "
                      "docs/agents.md); legal: null")
    if mt.num_repeat_rollouts is not None:
        errors.append(f"{MT}num_repeat_rollouts={mt.num_repeat_rollouts!r} is not supported (it repeats verl's "
                      "interaction rollouts); use actor_rollout_ref.rollout.n; legal: null")
    if agent.custom_async_server.path is not None or agent.custom_async_server.name is not None:
        errors.append(f"{AGENT}custom_async_server.path/name are not supported: rlsp's engine runs in-process in "
                      "every worker (vllm or hf); legal: null")


def _check_combinations(cfg: Any, errors: list[str]) -> None:
    r, mt = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.rollout.multi_turn
    if not agent_loops_enabled(cfg):
        for name in ("tool_config_path", "function_tool_path"):
            if mt[name]:
                errors.append(f"{MT}{name}={mt[name]!r} has no effect without agent loops: set {MT}enable=true "
                              f"(and {AGENT}default_agent_loop=tool_agent, or agent_name=tool_agent in the data)")
        return
    if r.tensor_model_parallel_size > 1:
        errors.append(f"agent loops ({_why(cfg)}) with actor_rollout_ref.rollout.tensor_model_parallel_size="
                      f"{r.tensor_model_parallel_size}: the ranks of one tp engine must issue identical generate "
                      "calls, and agent loops batch their turns as tools finish; legal: tensor_model_parallel_size=1")
    if r.ignore_eos:
        errors.append(f"agent loops ({_why(cfg)}) with actor_rollout_ref.rollout.ignore_eos=true: an assistant turn would never "
                      "end; legal: ignore_eos=false")


def _why(cfg: Any) -> str:
    r = cfg.actor_rollout_ref.rollout
    if r.multi_turn.enable:
        return f"{MT}enable=true"
    if r.agent.default_agent_loop != "single_turn_agent":
        return f"{AGENT}default_agent_loop={r.agent.default_agent_loop}"
    return f"{AGENT}agent_loop_config_path={r.agent.agent_loop_config_path}"


def check_multi_turn(cfg: Any, errors: list[str]) -> None:
    """Every multi_turn.* / agent.* value and the combinations that cannot work together."""
    _check_values(cfg, errors)
    _check_refused(cfg, errors)
    _check_combinations(cfg, errors)
