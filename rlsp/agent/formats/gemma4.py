"""gemma4 (Gemma 4): `<|tool_call>call:NAME{key:value,...}<tool_call|>`, values in Gemma's own notation.

    Let me look.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,opts:{units:<|"|>C<|"|>}}<tool_call|>

Strings are delimited by `<|"|>`; objects `{k:v,...}` (bare keys), arrays `[v,...]`, and bare `true`,
`false`, `null` and numbers. Anything else is an error of the call (a bare word is not a string here).
The model does not end its turn after `<tool_call|>`: that token is a stop token of the format.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlsp.agent.formats.common import ParameterSchemas, Scan, failed, shown, split_blocks, unclosed
from rlsp.agent.types import ToolCall

OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
STOP_TOKENS = (CLOSE,)
_NAME = re.compile(r"call:([\w.\-]+)")
_KEY = re.compile(r"\s*([\w.\-]+)\s*:")
_BARE = re.compile(r"[^,}\]]*")


class _Bad(ValueError):
    pass


def _value(text: str, pos: int) -> tuple[Any, int]:
    """The value starting at `pos` (leading spaces allowed) and the position after it."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        if end < 0:
            raise _Bad(f"unterminated {QUOTE} string")
        return text[pos + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", pos):
        return _items(text, pos + 1, "}", keyed=True)
    if text.startswith("[", pos):
        return _items(text, pos + 1, "]", keyed=False)
    bare = _BARE.match(text, pos).group(0)
    try:
        value = json.loads(bare.strip())
    except json.JSONDecodeError:
        raise _Bad(f"bare value {bare.strip()!r} is not true, false, null or a number") from None
    if isinstance(value, str | list | dict):
        raise _Bad(f"bare value {bare.strip()!r} is not true, false, null or a number")
    return value, pos + len(bare)


def _items(text: str, pos: int, close: str, keyed: bool) -> tuple[Any, int]:
    """An object's `k:v` or an array's `v` items up to `close`; `pos` is just after the opening bracket."""
    out: dict[str, Any] | list[Any] = {} if keyed else []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith(close, pos):
            return out, pos + 1
        if out and not text.startswith(",", pos):
            raise _Bad(f"expected ',' or {close!r} at {text[pos:pos + 20]!r}")
        pos += 1 if out else 0
        if keyed:
            key = _KEY.match(text, pos)
            if key is None:
                raise _Bad(f"expected key: at {text[pos:pos + 20]!r}")
            value, pos = _value(text, key.end())
            out[key.group(1)] = value
        else:
            value, pos = _value(text, pos)
            out.append(value)


def _call(body: str) -> ToolCall:
    match = _NAME.match(body.strip())
    if match is None:
        return failed(f"tool call does not start with call:NAME: {shown(body)}")
    name, rest = match.group(1), body.strip()[match.end():]
    if not rest.startswith("{"):
        return failed(f"the call of {name!r} has no {{...}} arguments: {shown(body)}", name)
    try:
        arguments, end = _items(rest, 1, "}", keyed=True)
    except _Bad as exc:
        return failed(f"the arguments of {name!r} cannot be read ({exc}): {shown(body)}", name)
    if rest[end:].strip():
        return failed(f"text after the arguments of {name!r}: {shown(rest[end:])}", name)
    return ToolCall(name=name, arguments=arguments)


def parse(text: str, schemas: ParameterSchemas | None = None) -> tuple[str, list[ToolCall]]:
    outside, bodies, cut = split_blocks(text, OPEN, CLOSE)
    scan = Scan(outside, [_call(body) for body in bodies])
    if cut is not None:
        match = _NAME.match(cut.strip())
        scan.calls.append(unclosed(OPEN, CLOSE, cut, match.group(1) if match and "{" in cut else ""))
    return scan.result()
