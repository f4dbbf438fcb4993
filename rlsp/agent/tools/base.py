"""The async tool interface (verl's `BaseTool` names and shapes) and `FunctionTool`, which wraps a typed function.

A tool's per-trajectory state lives in an *instance*: `create` makes it when the trajectory first calls the
tool, every later call of that trajectory reuses it, and `release` drops it when the trajectory ends
(rlsp.agent.tools.session.ToolSession does this bookkeeping). verl recreates the instance on every call;
keeping it lets a tool remember earlier calls (a sandbox, a counter, a scratchpad).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolResponse:
    """What a tool call answers the model with (text only)."""

    text: str = ""


def _validate_schema(tool_schema: Any) -> str:
    """Check that `tool_schema` is an OpenAI function schema and return the function's name."""
    if not isinstance(tool_schema, dict):
        raise ValueError(f"tool_schema must be a mapping {{'type': 'function', 'function': {{'name': ...}}}}, "
                         f"got {type(tool_schema).__name__}: {tool_schema!r}")
    if tool_schema.get("type") != "function":
        raise ValueError(f"tool_schema.type must be 'function' (the only legal value), got "
                         f"{tool_schema.get('type')!r} in {tool_schema!r}")
    function = tool_schema.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"tool_schema.function must be a mapping with 'name', 'description' and 'parameters', "
                         f"got {function!r}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool_schema.function.name must be a non-empty string, got {name!r}")
    return name


class BaseTool:
    """A tool the model can call: an OpenAI function schema plus async create / execute / calc_reward / release.

    `config` is the tool's own settings (the `config` mapping of verl's tool YAML); `tool_schema` is
    `{"type": "function", "function": {"name", "description", "parameters"}}` and is what the chat
    template shows the model. Subclasses implement `execute` and may override the other methods.
    """

    def __init__(self, config: dict[str, Any] | None, tool_schema: dict[str, Any]) -> None:
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"a tool's config must be a mapping, got {type(config).__name__}: {config!r}")
        self.config: dict[str, Any] = dict(config or {})
        self._name = _validate_schema(tool_schema)
        self.tool_schema: dict[str, Any] = copy.deepcopy(tool_schema)
        # instance id -> that trajectory's state (by default the creation arguments).
        self._instances: dict[str, dict[str, Any]] = {}

    @property
    def name(self) -> str:
        """The function name the model calls this tool by."""
        return self._name

    def get_openai_tool_schema(self) -> dict[str, Any]:
        """The tool's OpenAI function schema (a copy, so callers cannot change the tool's own)."""
        return copy.deepcopy(self.tool_schema)

    def state(self, instance_id: str) -> dict[str, Any]:
        """The mutable state of one live instance (created by `create`, dropped by `release`)."""
        if instance_id not in self._instances:
            raise RuntimeError(f"tool {self.name!r} has no live instance {instance_id!r}; "
                               f"live instances: {sorted(self._instances)}")
        return self._instances[instance_id]

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start one trajectory's instance; `kwargs` are its creation arguments (e.g. a ground truth)."""
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        self._instances[instance_id] = dict(kwargs)
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse | str, float, dict[str, Any]]:
        """Run one call with the model's `parameters`; returns (response, step reward, metrics)."""
        raise NotImplementedError(f"tool {self.name!r} ({type(self).__name__}) does not implement execute")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's reward at the end of the trajectory (none by default)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """End one trajectory's instance and drop its state."""
        self._instances.pop(instance_id, None)


def _function_schema(fn: Callable[..., Any], source: str) -> dict[str, Any]:
    """The OpenAI schema of a typed, Google-docstringed function, as transformers derives it."""
    # Imported here: transformers is heavy and only function tools need it.
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers raises its own exception types for missing hints or docs
        raise ValueError(
            f"cannot derive a tool schema for function {fn.__name__!r} in {source}: {exc} "
            "(a function tool needs type hints on every parameter and a Google-style docstring with a "
            "description and an 'Args:' entry per parameter)") from exc


def _to_text(value: Any) -> str:
    """A function's return value as the text the model sees."""
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


class FunctionTool(BaseTool):
    """A tool made from a plain typed Python function (sync or async).

    The schema comes from the function's type hints and Google-style docstring. Calls pass the model's
    parameters as keyword arguments; a sync function runs in a worker thread so that a slow one does not
    stall the other trajectories sharing the event loop.
    """

    def __init__(self, fn: Callable[..., Any], source: str | None = None) -> None:
        if not callable(fn):
            raise ValueError(f"FunctionTool needs a function, got {type(fn).__name__}: {fn!r}")
        where = source or getattr(fn, "__module__", "<unknown module>")
        super().__init__({}, _function_schema(fn, where))
        self.fn = fn
        self.source = where
        self._is_async = inspect.iscoroutinefunction(fn)

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse | str, float, dict[str, Any]]:
        """Call the function with `parameters` as keyword arguments; its return value becomes the text."""
        if self._is_async:
            value = await self.fn(**parameters)
        else:
            value = await asyncio.to_thread(self.fn, **parameters)
        return ToolResponse(text=_to_text(value)), 0.0, {}
