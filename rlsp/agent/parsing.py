"""Tool calls parsed from an assistant turn's text, one parser per tool-call format.

`parse_tool_calls(text, fmt)` returns the assistant's content with the tool-call blocks removed and the
calls in the order written. A call that cannot be used as written (malformed JSON, no name, arguments
that are not an object, a block cut off by the token limit) is still returned, with `error` set, so
the agent loop can answer it with an error observation instead of silently dropping it.

Formats (`rlsp.config.choices.TOOL_CALL_FORMATS`, `multi_turn.format`):
* "hermes" (Hermes / Qwen2.5 style): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  the arguments may also be a JSON string holding an object (OpenAI's wire form); when absent they
  are `{}` (a tool without parameters).

Why not transformers' own response parser: transformers 5 has `tokenizer.parse_response(text,
prefix=...)`, but it only runs on tokenizers whose files carry a `response_template` (or with such a
schema passed in); the chat templates rlsp trains with mostly carry none. It also raises on the first
malformed JSON block for the whole response, where an RL rollout needs a per-call error to feed back.
So the parsers here are plain text parsers, independent of the tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from rlsp.agent.types import ToolCall
from rlsp.config.choices import TOOL_CALL_FORMATS

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)
_SHOWN_CHARS = 80  # how much of a bad block an error message quotes


def _shown(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def _arguments(raw: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The arguments as a dict, or None and why not. A JSON string holding an object is decoded."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            return None, f"arguments given as a string that is not valid JSON ({exc.msg}): {_shown(raw)}"
    if not isinstance(raw, dict):
        return None, f"arguments must be a JSON object, got {type(raw).__name__}: {_shown(json.dumps(raw))}"
    return raw, None


def _hermes_call(body: str) -> ToolCall:
    """One `<tool_call>` block's body as a ToolCall (with `error` set when it is unusable)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(name="", arguments=None, error=f"tool call is not valid JSON ({exc.msg}): {_shown(body)}")
    if not isinstance(obj, dict):
        return ToolCall(name="", arguments=None,
                        error=f"tool call must be a JSON object with 'name' and 'arguments', got {_shown(body)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(name="", arguments=None,
                        error=f"tool call has no 'name' string (got {name!r}): {_shown(body)}")
    # A missing 'arguments' is a call of a tool without parameters; an explicit null is not an object.
    arguments, error = _arguments(obj["arguments"]) if "arguments" in obj else ({}, None)
    return ToolCall(name=name, arguments=arguments, error=error)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Hermes-format calls: `<tool_call>` JSON `</tool_call>` blocks, anywhere in the text."""
    calls: list[ToolCall] = []
    pieces: list[str] = []
    pos = 0
    for match in _HERMES_BLOCK.finditer(text):
        pieces.append(text[pos:match.start()])
        calls.append(_hermes_call(match.group(1)))
        pos = match.end()
    tail = text[pos:]
    cut = tail.find(HERMES_OPEN)
    if cut >= 0:
        # An opening tag with no closing one: the generation hit its token limit inside the call.
        body = tail[cut + len(HERMES_OPEN):]
        calls.append(ToolCall(name="", arguments=None,
                              error=f"unclosed {HERMES_OPEN} block (no {HERMES_CLOSE}; was the generation "
                                    f"truncated?): {_shown(body)}"))
        tail = tail[:cut]
    pieces.append(tail)
    return "".join(pieces).strip(), calls


# Format name -> parser. Adding a format: a parser here and its name in TOOL_CALL_FORMATS.
PARSERS: dict[str, Callable[[str], tuple[str, list[ToolCall]]]] = {
    "hermes": parse_hermes,
}
assert tuple(PARSERS) == TOOL_CALL_FORMATS, (tuple(PARSERS), TOOL_CALL_FORMATS)


def parse_tool_calls(text: str, fmt: str = "hermes") -> tuple[str, list[ToolCall]]:
    """The content of an assistant turn without its tool-call blocks (stripped), and the calls in order.

    Calls that cannot be used carry `error` (and `arguments=None`); `name` is kept when it was readable.
    """
    parser = PARSERS.get(fmt)
    if parser is None:
        raise ValueError(f"unknown tool-call format {fmt!r}; legal formats: {list(TOOL_CALL_FORMATS)}")
    return parser(text)
