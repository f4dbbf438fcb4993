"""How an agent-loop run's data rows are rendered and which loop each row names: the tools' schemas for the
prompts (`agent_rows`) and the `agent_name` values checked against the registered loops. Used by the trainer's data
loading and by the start-up checks (rlsp.checks.preflight_agent)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlsp.agent.loop import registered_agent_loops
from rlsp.agent.runner import load_agent_loop_config
from rlsp.agent.tools.loading import load_tools, tool_schemas
from rlsp.config.run_spec import agent_loops_enabled
from rlsp.data.dataset import AgentRows

AGENT = "actor_rollout_ref.rollout.agent."


def agent_rows(cfg: Any) -> AgentRows | None:
    """How the datasets render rows for agent loops (None: a run without them). Loads the tools."""
    if not agent_loops_enabled(cfg):
        return None
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    tools = load_tools(mt.tool_config_path, mt.function_tool_path)
    return AgentRows(str(cfg.actor_rollout_ref.rollout.agent.default_agent_loop), tuple(tool_schemas(tools)))


def unknown_agent_loops(names: Iterable[str], where: str) -> list[str]:
    """Errors for loop names nobody registered (`where` says whose names they are)."""
    known = registered_agent_loops()
    return [f"{where}: agent loop {name!r} is not registered; registered: {known} (register more with "
            f"{AGENT}agent_loop_config_path)" for name in sorted(set(names)) if name not in known]


def check_agent_names(cfg: Any, datasets: Iterable[Any]) -> None:
    """Refuse data rows whose `agent_name` no loop is registered under (loads agent_loop_config_path)."""
    if cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path:
        load_agent_loop_config(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path)
    names = {item["agent_name"] for data in datasets if data is not None for item in data.items}
    errors = unknown_agent_loops(names, "data column agent_name")
    if errors:
        raise ValueError("invalid data:\n  - " + "\n  - ".join(errors))
