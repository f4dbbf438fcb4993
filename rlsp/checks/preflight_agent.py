"""Start-up checks of agent loops that need files: the tools (verl's tool YAML, function tools), the loops
registered by `agent.agent_loop_config_path`, the chat template's turn structure, and the `agent_name`
values of the data. Run in the driver before any worker has the run's config (rlsp.main and rlsp.check).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from rlsp.agent.chat import ChatTokens
from rlsp.agent.formats import check_chat_template
from rlsp.agent.rows import AGENT, unknown_agent_loops
from rlsp.agent.runner import load_agent_loop_config
from rlsp.agent.tools.loading import load_tools, tool_schemas
from rlsp.config.run_spec import agent_loops_enabled
from rlsp.data.dataset import chat_template_kwargs
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.preflight")


def agent_errors(cfg: DictConfig, tokenizer: Any) -> list[str]:
    """Every problem with the tools, the loop registry and the chat template of an agent-loop run."""
    if not agent_loops_enabled(cfg):
        return []
    r, errors = cfg.actor_rollout_ref.rollout, []
    tools: dict[str, Any] = {}
    try:
        tools = load_tools(r.multi_turn.tool_config_path, r.multi_turn.function_tool_path)
    except (ValueError, RuntimeError, TypeError) as exc:
        errors.append(str(exc))
    if r.agent.agent_loop_config_path:
        try:
            load_agent_loop_config(r.agent.agent_loop_config_path)
        except (ValueError, RuntimeError, TypeError) as exc:
            errors.append(str(exc))
    errors += unknown_agent_loops([r.agent.default_agent_loop], f"{AGENT}default_agent_loop")
    errors += _template_errors(cfg, tokenizer, tools)
    return errors


def _template_errors(cfg: DictConfig, tokenizer: Any, tools: dict[str, Any]) -> list[str]:
    """The chat template must end assistant turns with a token the engine stops at, and render tool turns
    after them without rewriting the history (what observation ids are cut from)."""
    path = cfg.actor_rollout_ref.model.path
    try:
        chat = ChatTokens(tokenizer, tool_schemas(tools) or None, chat_template_kwargs(cfg))
        ends = chat.end_of_turn_ids()
        check_chat_template(str(cfg.actor_rollout_ref.rollout.multi_turn.format), tokenizer, chat)
    except (ValueError, RuntimeError, TypeError, KeyError) as exc:
        return [f"multi-turn rollouts need a chat template with assistant and tool turns: the tokenizer of {path} "
                f"gives {type(exc).__name__}: {exc}"]
    if tools and not chat.tools_rendered():
        log.warning("the chat template of %s does not render tool schemas (tools=): describe the tools and the "
                    "call format in the prompt yourself (docs/agents.md)", path)
    stops = _stop_ids(path, tokenizer)
    if not ends & stops:
        names = [tokenizer.convert_ids_to_tokens(i) for i in sorted(ends)]
        return [f"the chat template of {path} ends assistant turns with {names} (ids {sorted(ends)}), which the model "
                f"does not stop at (generation_config eos_token_id: {sorted(stops)}): every turn would run to its "
                "token limit; add the id to eos_token_id in generation_config.json"]
    return []


def _stop_ids(path: str, tokenizer: Any) -> set[int]:
    """The ids generation stops at: generation_config.json's eos_token_id, else the tokenizer's EOS."""
    from transformers import GenerationConfig  # noqa: PLC0415

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    eos = tokenizer.eos_token_id if eos is None else eos
    return {eos} if isinstance(eos, int) else set(eos or [])


def describe_agent(cfg: DictConfig, rows_per_loop: dict[str, int], tokenizer: Any) -> list[str]:
    """What an agent-loop run will do, for `python -m rlsp.check`."""
    r, budget = cfg.actor_rollout_ref.rollout, cfg.data.max_response_length
    mt = r.multi_turn
    counts = ", ".join(f"{name}: {n}" for name, n in sorted(rows_per_loop.items())) or "unknown"
    lines = [f"agent loops: every sample runs its row's loop (agent_name; default {r.agent.default_agent_loop}); "
             f"train rows per loop: {counts}"]
    try:
        tools = load_tools(mt.tool_config_path, mt.function_tool_path)
    except (ValueError, RuntimeError, TypeError):
        tools = {}  # agent_errors names the problem
    lines.append(f"tools: {', '.join(tools) or 'none'}"
                 + (f" (chat template {'renders' if ChatTokens(tokenizer, tool_schemas(tools), chat_template_kwargs(cfg)).tools_rendered() else 'does NOT render'} "
                    "their schemas)" if tools and tokenizer is not None else ""))
    turns = lambda n: "no limit" if n is None else str(n)  # noqa: E731
    lines.append(f"turns: assistant {turns(mt.max_assistant_turns)}, tool {turns(mt.max_user_turns)}; each turn up to "
                 f"{mt.max_tokens_per_turn or 'what is left of the budget'} new tokens; data.max_response_length="
                 f"{budget} bounds the whole trajectory (every turn and all tool output)")
    lines.append(f"tool calls: {mt.format} format, {mt.max_parallel_calls} per turn, {mt.tool_timeout_s:g} s each, "
                 f"responses cut to {mt.max_tool_response_length} characters ({mt.tool_response_truncate_side})")
    steps = ("added at the end of the turn that earned them" if mt.use_step_rewards else
             "logged as agent/step_reward/mean, not trained on (multi_turn.use_step_rewards=false)")
    lines.append("rewards: the reward function sees the whole trajectory and extra_info num_turns, finish_reason, messages, "
                 f"tool_calls, tool_rewards; tool step rewards are {steps}")
    return lines
