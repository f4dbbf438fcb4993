"""glm (GLM-4.5 / 4.6 / 4.7): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`.

    <think>...</think>
    Let me look.
    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

The `<think>` block is reasoning, not content (calls written in it are not calls). Values are read by
the tool's schema (the template writes strings raw and other values as JSON). The model ends a calling
turn with `<|observation|>` (a stop token of the format), the others with its EOS.
"""

from __future__ import annotations

from rlsp.agent.formats.common import (
    ParameterSchemas,
    Scan,
    drop_reasoning,
    failed,
    shown,
    split_blocks,
    typed_call,
    unclosed,
)
from rlsp.agent.types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
STOP_TOKENS = ("<|observation|>",)


def _name(body: str) -> str:
    cut = body.find(KEY)
    return (body if cut < 0 else body[:cut]).strip()


def _call(body: str, schemas: ParameterSchemas | None) -> ToolCall:
    name = _name(body)
    pairs: list[tuple[str, str]] = []
    pos = body.find(KEY)
    while pos >= 0:
        key_end = body.find(KEY_END, pos)
        value = body.find(VALUE, key_end) if key_end >= 0 else -1
        value_end = body.find(VALUE_END, value) if value >= 0 else -1
        if value_end < 0 or body[key_end + len(KEY_END):value].strip():
            return failed(f"an argument of {name!r} is not {KEY}K{KEY_END}{VALUE}V{VALUE_END}: "
                          f"{shown(body[pos:])}", name)
        pairs.append((body[pos + len(KEY):key_end].strip(), body[value + len(VALUE):value_end]))
        pos = body.find(KEY, value_end)
    return typed_call(name, pairs, schemas, body)


def parse(text: str, schemas: ParameterSchemas | None = None) -> tuple[str, list[ToolCall]]:
    outside, bodies, cut = split_blocks(drop_reasoning(text), OPEN, CLOSE)
    scan = Scan(outside, [_call(body, schemas) for body in bodies])
    if cut is not None:
        scan.calls.append(unclosed(OPEN, CLOSE, cut, _name(cut) if "\n" in cut or KEY in cut else ""))
    return scan.result()
