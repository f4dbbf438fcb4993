"""minimax (MiniMax-M2): `<invoke>` elements inside `<minimax:tool_call>` blocks, several per block.

    <think>...</think>
    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

MiniMax-M2 keeps its `<think>` blocks in the content of later turns (interleaved thinking), so they stay
in the content here. Values are read by the tool's schema. Turns end with `[e~[`: no extra stop token.
`invoke_calls` also reads DeepSeek-V4's DSML invokes (same shape, other tag names).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from rlsp.agent.formats.common import ParameterSchemas, Scan, failed, shown, split_blocks, typed_call, unclosed
from rlsp.agent.types import ToolCall

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_ATTRIBUTE = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class InvokeTags:
    invoke: str = "<invoke"
    invoke_end: str = "</invoke>"
    parameter: str = "<parameter"
    parameter_end: str = "</parameter>"


# Builds the call from its name, its parameters as (attributes, text) pairs and the block (for errors).
MakeCall = Callable[[str, list[tuple[dict[str, str], str]], str], ToolCall]


def _attributes(header: str) -> dict[str, str]:
    return dict(_ATTRIBUTE.findall(header))


def _invoke(body: str, tags: InvokeTags, make: MakeCall) -> ToolCall:
    """One `<invoke name="...">...</invoke>` element (body starts at the invoke tag)."""
    head_end = body.find(">")
    name = _attributes(body[:head_end]).get("name", "") if head_end >= 0 else ""
    end = body.find(tags.invoke_end)
    if not name or end < 0:
        return failed(f"tool call is not {tags.invoke} name=\"NAME\">...{tags.invoke_end}: {shown(body)}", name)
    params: list[tuple[dict[str, str], str]] = []
    inner, pos = body[head_end + 1:end], 0
    while (p := inner.find(tags.parameter, pos)) >= 0:
        header_end = inner.find(">", p)
        close = inner.find(tags.parameter_end, header_end + 1) if header_end >= 0 else -1
        attrs = _attributes(inner[p:header_end]) if header_end >= 0 else {}
        if close < 0 or "name" not in attrs:
            return failed(f"a parameter of {name!r} is not {tags.parameter} name=\"K\">V{tags.parameter_end}: "
                          f"{shown(inner[p:])}", name)
        params.append((attrs, inner[header_end + 1:close]))
        pos = close + len(tags.parameter_end)
    return make(name, params, body)


def invoke_calls(block: str, tags: InvokeTags, make: MakeCall) -> list[ToolCall]:
    """Every invoke of one block, in order (a block without one is one failed call)."""
    starts = [m.start() for m in re.finditer(re.escape(tags.invoke) + r"[\s>]", block)]
    if not starts:
        return [failed(f"tool-call block without {tags.invoke} name=\"NAME\">: {shown(block)}")]
    return [_invoke(block[a:b], tags, make) for a, b in zip(starts, [*starts[1:], len(block)])]


def parse(text: str, schemas: ParameterSchemas | None = None) -> tuple[str, list[ToolCall]]:
    def make(name: str, params: list[tuple[dict[str, str], str]], body: str) -> ToolCall:
        return typed_call(name, [(attrs["name"], value) for attrs, value in params], schemas, body)

    outside, bodies, cut = split_blocks(text, OPEN, CLOSE)
    scan = Scan(outside, [call for body in bodies for call in invoke_calls(body, InvokeTags(), make)])
    if cut is not None:
        scan.calls.append(unclosed(OPEN, CLOSE, cut))
    return scan.result()
