"""hermes (Hermes / Qwen2.5 / Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

The arguments may also be a JSON string holding an object (OpenAI's wire form); when absent they are `{}`
(a tool without parameters). The model ends the turn with its end-of-turn token (`<|im_end|>`): no extra
stop token.
"""

from __future__ import annotations

import json

from rlsp.agent.formats.common import ParameterSchemas, Scan, failed, json_arguments, shown, split_blocks, unclosed
from rlsp.agent.types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def json_call(body: str, what: str = "tool call") -> ToolCall:
    """A `{"name": ..., "arguments": ...}` JSON body as a ToolCall (with `error` set when it is unusable)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return failed(f"{what} is not valid JSON ({exc.msg}): {shown(body)}")
    if not isinstance(obj, dict):
        return failed(f"{what} must be a JSON object with 'name' and 'arguments', got {shown(body)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return failed(f"{what} has no 'name' string (got {name!r}): {shown(body)}")
    # A missing 'arguments' is a call of a tool without parameters; an explicit null is not an object.
    arguments, error = json_arguments(obj["arguments"]) if "arguments" in obj else ({}, None)
    return ToolCall(name=name, arguments=arguments, error=error)


def parse(text: str, schemas: ParameterSchemas | None = None) -> tuple[str, list[ToolCall]]:
    outside, bodies, cut = split_blocks(text, OPEN, CLOSE)
    scan = Scan(outside, [json_call(body) for body in bodies])
    if cut is not None:
        scan.calls.append(unclosed(OPEN, CLOSE, cut))
    return scan.result()
