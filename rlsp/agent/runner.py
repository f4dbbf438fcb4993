"""AgentRunner: one worker's agent machinery, built once from the config, and `run` for one batch of trajectories.

`run` starts every trajectory's agent loop on an event loop in a helper thread and serves their generation
requests with the rollout engine on the calling thread (rlsp.agent.server). A loop that raises stops the
batch with its name and the row; tool faults never do (they become error observations).

`load_agent_loop_config(path)` reads verl's agent-loop YAML: a list of `{name, _target_}` entries, each
`_target_` an importable AgentLoop subclass ("pkg.module.Class", or "path/to/file.py:Class").
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import yaml

from rlsp.agent import tool_loop  # noqa: F401 -- registers tool_agent
from rlsp.agent.chat import ChatTokens
from rlsp.agent.loop import (
    AgentEnv,
    AgentLoop,
    AgentLoopOutput,
    AgentSample,
    AgentSettings,
    agent_loop_class,
    register_agent_loop,
)
from rlsp.agent.server import TRAJECTORY_IMAGES, GenerationServer, ServeStats
from rlsp.agent.tools.loading import load_tools, tool_schemas
from rlsp.rollout.base import RolloutEngine, SamplingConfig

LOOP_CONFIG_KEY = "actor_rollout_ref.rollout.agent.agent_loop_config_path"


def agent_settings(multi_turn: Any) -> AgentSettings:
    """actor_rollout_ref.rollout.multi_turn as AgentSettings (None for unset limits)."""
    return AgentSettings(
        max_assistant_turns=multi_turn.max_assistant_turns, max_user_turns=multi_turn.max_user_turns,
        max_parallel_calls=int(multi_turn.max_parallel_calls),
        max_tool_response_length=int(multi_turn.max_tool_response_length),
        tool_response_truncate_side=str(multi_turn.tool_response_truncate_side),
        tool_timeout_s=float(multi_turn.tool_timeout_s), max_tokens_per_turn=multi_turn.max_tokens_per_turn,
        format=str(multi_turn.format), use_step_rewards=bool(multi_turn.use_step_rewards),
    )


def _import_target(target: str, where: str) -> Any:
    if ":" in target and target.split(":", 1)[0].endswith(".py"):
        path, name = target.split(":", 1)
        if not os.path.isfile(path):
            raise ValueError(f"{where}: _target_ {target!r}: no file {path!r}")
        module_name = f"rlsp_user_agent_{abs(hash(os.path.abspath(path)))}"
        module = sys.modules.get(module_name)  # loaded once per process: its classes keep one identity
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    else:
        module_name, _, name = target.rpartition(".")
        if not module_name:
            raise ValueError(f"{where}: _target_ {target!r} must be 'package.module.Class' or 'file.py:Class'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{where}: _target_ {target!r}: cannot import {module_name!r} ({exc})") from exc
    if not hasattr(module, name):
        raise ValueError(f"{where}: _target_ {target!r}: {module.__name__} has no {name!r}")
    return getattr(module, name)


def load_agent_loop_config(path: str) -> list[str]:
    """Register the loops listed in verl's agent-loop YAML; returns their names."""
    where = f"{LOOP_CONFIG_KEY}={path}"
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file")
    entries = yaml.safe_load(open(path, encoding="utf-8"))
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a YAML list of {{name, _target_}} entries, got {type(entries).__name__}")
    names = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry.get("_target_"):
            raise ValueError(f"{where}: entry {i} needs 'name' and '_target_' (got {entry!r})")
        cls = _import_target(str(entry["_target_"]), where)
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise ValueError(f"{where}: {entry['_target_']} is not a subclass of rlsp.agent.loop.AgentLoop")
        register_agent_loop(entry["name"])(cls)
        names.append(entry["name"])
    return names


class AgentRunner:
    def __init__(self, rollout_cfg: Any, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        mt, agent = rollout_cfg.multi_turn, rollout_cfg.agent
        self.tokenizer = tokenizer
        self.settings = agent_settings(mt)
        self.tools = load_tools(mt.tool_config_path, mt.function_tool_path)
        self.chat = ChatTokens(tokenizer, tool_schemas(self.tools) or None, template_kwargs)
        if agent.agent_loop_config_path:
            load_agent_loop_config(agent.agent_loop_config_path)
        self.default_loop = str(agent.default_agent_loop)
        agent_loop_class(self.default_loop)  # unknown names fail here, at start-up

    def run(self, engine: RolloutEngine, samples: list[AgentSample], loop_names: list[str | None],
            sampling: SamplingConfig, version: int = 0,
            on_boundary: Callable[[], int] | None = None) -> tuple[list[AgentLoopOutput], ServeStats]:
        """Run one agent loop per sample (`loop_names[i]`, None = the default loop) to completion."""
        server = GenerationServer(sampling, version)
        env = AgentEnv(server, self.tokenizer, self.tools, self.settings, self.chat)
        names = [name or self.default_loop for name in loop_names]
        loops = [agent_loop_class(name)(env) for name in names]
        result: dict[str, Any] = {}
        thread = threading.Thread(target=self._run_loops, args=(server, loops, samples, names, result),
                                  name="rlsp-agent-loops", daemon=True)
        server.started(len(loops))
        thread.start()
        try:
            stats = server.serve(engine, on_boundary)
        finally:
            thread.join()
        if "error" in result:
            raise result["error"]
        return result["outputs"], stats

    @staticmethod
    def _run_loops(server: GenerationServer, loops: list[AgentLoop], samples: list[AgentSample],
                   names: list[str], result: dict[str, Any]) -> None:
        async def one(i: int) -> AgentLoopOutput:
            TRAJECTORY_IMAGES.set(samples[i].multi_modal_inputs)  # this task's own context (asyncio.gather)
            try:
                return await loops[i].run(samples[i])
            except Exception as exc:
                raise RuntimeError(f"agent loop {names[i]!r} failed on sample {i} (row extra_info "
                                   f"{ {k: samples[i].extra_info.get(k) for k in ('index', 'split') if k in samples[i].extra_info} }): "
                                   f"{type(exc).__name__}: {exc}") from exc
            finally:
                server.ended()

        async def all_loops() -> list[AgentLoopOutput]:
            return list(await asyncio.gather(*(one(i) for i in range(len(loops)))))

        # Not asyncio.run: it would wait for the default executor, and a hung synchronous tool (run in a
        # thread, timed out) would then hang the batch; its thread is left behind instead.
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            result["outputs"] = loop.run_until_complete(all_loops())
        except BaseException as exc:  # noqa: BLE001 -- handed to the engine's thread, which re-raises it
            result["error"] = exc
            server.abort()
        finally:
            server.finish()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()
            asyncio.set_event_loop(None)
