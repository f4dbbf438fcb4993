"""One trajectory's tools: `ToolSession` runs a turn's tool calls concurrently with timeouts and limits.

A tool's instance is created on the trajectory's first call of that tool (with the row's `create_kwargs`),
kept for the rest of the trajectory, and released by `close`. Tool faults (unknown tool, malformed
arguments, an exception, a timeout, too many calls in one turn) never raise: each becomes a `ToolResult`
whose text tells the model what went wrong, and is counted in `counts` for the logs.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from rlsp.agent.tools.base import BaseTool, ToolResponse
from rlsp.agent.types import ToolCall
from rlsp.config.choices import TRUNCATE_SIDES

TRUNCATION_MARKER = "...(truncated)..."
ERROR_KINDS = ("unknown_tool", "bad_arguments", "raised", "timeout", "too_many_calls")


def truncate_text(text: str, limit: int, side: str) -> tuple[str, bool]:
    """Keep at most `limit` characters of `text`; returns (text, whether it was cut).

    verl's sides: "left" keeps the left part (the start), "right" keeps the right part (the end), "middle"
    keeps both ends. A marker takes the place of what was cut, within the limit, when there is room for it.
    """
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side {side!r} is not legal; legal sides: {', '.join(TRUNCATE_SIDES)}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"truncate limit {limit!r} must be a positive number of characters")
    if len(text) <= limit:
        return text, False
    marker = TRUNCATION_MARKER if limit > len(TRUNCATION_MARKER) else ""
    keep = limit - len(marker)
    if side == "left":
        return text[:keep] + marker, True
    if side == "right":
        return marker + text[len(text) - keep:], True
    head = (keep + 1) // 2
    return text[:head] + marker + text[len(text) - (keep - head):], True


@dataclass
class ToolResult:
    """The answer to one tool call: the observation text for the model plus reward, metrics and fault kind."""

    name: str
    text: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    # One of ERROR_KINDS, or None when the tool ran and answered.
    error: str | None = None
    latency_s: float = 0.0
    truncated: bool = False


def _kwargs_of(tools_kwargs: dict[str, Any], name: str, key: str) -> dict[str, Any]:
    """One tool's `create_kwargs` or `execute_kwargs` from a row's `tools_kwargs` ({} when absent)."""
    per_tool = tools_kwargs.get(name) or {}
    if not isinstance(per_tool, dict):
        raise ValueError(f"tools_kwargs[{name!r}] must be a mapping with 'create_kwargs' and/or "
                         f"'execute_kwargs', got {per_tool!r}")
    value = per_tool.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"tools_kwargs[{name!r}][{key!r}] must be a mapping of keyword arguments, got {value!r}")
    return value


def _unpack(name: str, out: Any) -> tuple[str, float, dict[str, float]]:
    """Check a tool's execute result (response, reward, metrics) and bring it to (text, float, metrics)."""
    if not isinstance(out, tuple) or len(out) != 3 or not isinstance(out[2], dict):
        raise RuntimeError(f"tool {name!r} returned {out!r}; execute must return (response, reward, metrics)")
    response, reward, metrics = out
    text = response.text if isinstance(response, ToolResponse) else str(response)
    # Summed per trajectory (counts' metrics/<key>) and averaged over the batch in the logs: numbers only.
    numbers = {str(k): float(v) for k, v in metrics.items() if isinstance(v, int | float)}
    return text, float(reward), numbers


class ToolSession:
    """The tools of one trajectory: lazily created instances, concurrent calls, and fault-tolerant results."""

    def __init__(self, tools: dict[str, BaseTool], tools_kwargs: dict[str, dict] | None, *, timeout_s: float,
                 max_response_chars: int, truncate_side: str, max_parallel_calls: int) -> None:
        if not timeout_s > 0:
            raise ValueError(f"tool timeout_s={timeout_s!r} must be a positive number of seconds")
        if isinstance(max_parallel_calls, bool) or not isinstance(max_parallel_calls, int) or max_parallel_calls < 1:
            raise ValueError(f"max_parallel_calls={max_parallel_calls!r} must be an integer >= 1")
        if tools_kwargs is not None and not isinstance(tools_kwargs, dict):
            raise ValueError(f"tools_kwargs must be a mapping {{tool name: {{'create_kwargs': ..., "
                             f"'execute_kwargs': ...}}}}, got {tools_kwargs!r}")
        truncate_text("", max_response_chars, truncate_side)  # validates both before the first call
        for name in tools_kwargs or {}:  # a malformed row fails here, not as a tool fault mid-trajectory
            _kwargs_of(tools_kwargs, name, "create_kwargs")
            _kwargs_of(tools_kwargs, name, "execute_kwargs")
        self.tools = tools
        self.tools_kwargs: dict[str, Any] = tools_kwargs or {}
        self.timeout_s = float(timeout_s)
        self.max_response_chars = max_response_chars
        self.truncate_side = truncate_side
        self.max_parallel_calls = max_parallel_calls
        self._instances: dict[str, str] = {}  # tool name -> this trajectory's instance id
        self._create_locks: dict[str, asyncio.Lock] = {}
        self._counts: dict[str, float] = {"calls": 0, "truncated": 0, "latency_s": 0.0, "release_errors": 0}
        self._counts.update({f"errors/{kind}": 0 for kind in ERROR_KINDS})

    @property
    def counts(self) -> dict[str, float]:
        """Counters for the logs: calls, errors per kind, truncated responses, total latency, release errors
        and the tools' own metrics summed over their calls (metrics/<key>)."""
        return dict(self._counts)

    async def call(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Answer one turn's calls, in order; at most `max_parallel_calls` run, concurrently."""
        ran = await asyncio.gather(*(self._call_one(c) for c in calls[:self.max_parallel_calls]))
        refused = [self._error(c.name, "too_many_calls",
                               f"Error: too many tool calls in one turn ({len(calls)}); at most "
                               f"{self.max_parallel_calls} run per turn, so this call was not run")
                   for c in calls[self.max_parallel_calls:]]
        results = list(ran) + refused
        for result in results:
            self._count(result)
        return results

    async def close(self) -> float:
        """Ask every instance this trajectory created for its final reward (`calc_reward`), then release it;
        returns the sum of those rewards. A failing calc_reward or release is counted, not raised."""
        instances, self._instances = self._instances, {}
        total = 0.0
        for name, instance_id in instances.items():
            try:
                total += float(await asyncio.wait_for(self.tools[name].calc_reward(instance_id), self.timeout_s))
            except Exception:  # a tool's fault must not fail the trajectory
                self._counts["release_errors"] += 1
            try:
                await asyncio.wait_for(self.tools[name].release(instance_id), self.timeout_s)
            except Exception:
                self._counts["release_errors"] += 1
        return total

    async def _call_one(self, call: ToolCall) -> ToolResult:
        start = time.perf_counter()
        if call.error is not None or call.arguments is None:  # unusable as written: say why, whatever the name
            reason = call.error or "no arguments"
            which = f"the call to {call.name!r}" if call.name else "the tool call"
            result = self._error(call.name, "bad_arguments", f"Error: {which} could not be used: {reason}")
        elif call.name not in self.tools:
            result = self._error(call.name, "unknown_tool", f"Error: unknown tool {call.name!r}; available: "
                                 f"{', '.join(self.tools) or '(none)'}")
        else:
            try:
                result = await asyncio.wait_for(self._run(call), self.timeout_s)
            except TimeoutError:  # only wait_for's own timeout gets here: _run catches the tool's exceptions
                result = self._error(call.name, "timeout",
                                     f"Error: tool {call.name!r} timed out after {self.timeout_s:g} s")
        result.latency_s = time.perf_counter() - start
        return result

    async def _run(self, call: ToolCall) -> ToolResult:
        """Create the instance if needed and execute; any exception from the tool becomes a "raised" result."""
        try:
            instance_id = await self._instance(call.name)
            execute_kwargs = _kwargs_of(self.tools_kwargs, call.name, "execute_kwargs")
            out = await self.tools[call.name].execute(instance_id, dict(call.arguments or {}), **execute_kwargs)
            text, reward, metrics = _unpack(call.name, out)
        except Exception as exc:
            return self._error(call.name, "raised", f"Error: tool {call.name!r} failed: {type(exc).__name__}: {exc}")
        text, truncated = truncate_text(text, self.max_response_chars, self.truncate_side)
        return ToolResult(name=call.name, text=text, reward=reward, metrics=metrics, truncated=truncated)

    async def _instance(self, name: str) -> str:
        # A lock per tool: two calls of the same tool in one turn must share one instance, not create two.
        lock = self._create_locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self._instances:
                create_kwargs = _kwargs_of(self.tools_kwargs, name, "create_kwargs")
                instance_id, _ = await self.tools[name].create(**create_kwargs)
                self._instances[name] = instance_id
            return self._instances[name]

    def _error(self, name: str, kind: str, text: str) -> ToolResult:
        text, truncated = truncate_text(text, self.max_response_chars, self.truncate_side)
        return ToolResult(name=name, text=text, error=kind, truncated=truncated)

    def _count(self, result: ToolResult) -> None:
        for key, value in result.metrics.items():  # the tool's own metrics, summed over its calls
            self._counts[f"metrics/{key}"] = self._counts.get(f"metrics/{key}", 0.0) + float(value)
        self._counts["calls"] += 1
        self._counts["latency_s"] += result.latency_s
        self._counts["truncated"] += int(result.truncated)
        if result.error is not None:
            self._counts[f"errors/{result.error}"] += 1
