"""What the tool-call format parsers share: error quoting, argument checks, and schema-typed parameter values.

Formats that write each parameter as its own text element (qwen3_coder, glm, seed, minimax) carry no JSON
types: `"3"` may be the integer 3 or the string "3". `convert_parameter` reads the value by the tool's
JSON schema when the loop knows it (`parameter_schemas`), else JSON-decodes it when it parses, else keeps
the raw string. A value the schema's type cannot read is an error of the call, not a silent string.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlsp.agent.types import ToolCall

SHOWN_CHARS = 80  # how much of a bad block an error message quotes
# tool name -> {parameter name -> its JSON schema}; from the tools' OpenAI function schemas.
ParameterSchemas = Mapping[str, Mapping[str, Any]]
JSON_TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")


def shown(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "...")


def failed(error: str, name: str = "") -> ToolCall:
    """A call that cannot be run as written (it is answered with an error observation)."""
    return ToolCall(name=name, arguments=None, error=error)


def json_arguments(raw: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Arguments as a dict, or None and why not. A JSON string holding an object is decoded."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            return None, f"arguments given as a string that is not valid JSON ({exc.msg}): {shown(raw)}"
    if not isinstance(raw, dict):
        return None, f"arguments must be a JSON object, got {type(raw).__name__}: {shown(json.dumps(raw))}"
    return raw, None


def parameter_schemas(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """{tool name: {parameter: schema}} from OpenAI function schemas (`{"type": "function", "function": ...}`)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            params = function.get("parameters") or {}
            props = params.get("properties") if isinstance(params, Mapping) else None
            out[function["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _as_type(text: str, kind: str) -> tuple[bool, Any]:
    """(True, value) when `text` reads as JSON type `kind`, else (False, None)."""
    if kind == "string":
        return True, text
    value_text = text.strip()
    if kind == "integer":
        try:
            return True, int(value_text)
        except ValueError:
            try:  # "3.0" is the integer 3 in JSON Schema
                number = float(value_text)
            except ValueError:
                return False, None
            return (True, int(number)) if math.isfinite(number) and number.is_integer() else (False, None)
    if kind == "number":
        try:
            return True, int(value_text)
        except ValueError:
            pass
        try:
            number = float(value_text)
        except ValueError:
            return False, None
        return (True, number) if math.isfinite(number) else (False, None)
    if kind == "boolean":
        lowered = value_text.lower()
        return (True, lowered == "true") if lowered in ("true", "false") else (False, None)
    if kind == "null":
        return (True, None) if value_text == "null" else (False, None)
    try:
        value = json.loads(value_text)
    except json.JSONDecodeError:
        return False, None
    ok = isinstance(value, dict) if kind == "object" else isinstance(value, list)
    return ok, value if ok else None


def convert_parameter(raw: str, schema: Mapping[str, Any] | None) -> tuple[Any, str | None]:
    """A text parameter value as the schema's type says (see the module docstring); (value, error)."""
    kinds = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    kinds = [k for k in kinds if k in JSON_TYPES]
    if not kinds:  # no schema, or a type rlsp cannot check: JSON when it parses, else the text itself
        try:
            return json.loads(raw), None
        except json.JSONDecodeError:
            return raw, None
    # A string type reads any text, so it is tried last ("null" for ["string", "null"] is null).
    for kind in sorted(kinds, key=lambda k: k == "string"):
        ok, value = _as_type(raw, kind)
        if ok:
            return value, None
    return None, f"is not {' or '.join(kinds)}: {shown(raw)}"


@dataclass
class Scan:
    """Content pieces and calls collected while walking one assistant turn's text."""

    content: list[str]
    calls: list[ToolCall]

    def result(self) -> tuple[str, list[ToolCall]]:
        return "".join(self.content).strip(), self.calls


def typed_call(name: str, pairs: list[tuple[str, str]], schemas: ParameterSchemas | None,
               block: str) -> ToolCall:
    """A call whose parameters were written as (name, text) pairs, each value read by the tool's schema."""
    if not name:
        return failed(f"tool call has no function name: {shown(block)}")
    props = (schemas or {}).get(name, {})
    arguments: dict[str, Any] = {}
    for key, raw in pairs:
        if key in arguments:
            return failed(f"parameter {key!r} is given twice in the call of {name!r}: {shown(block)}", name)
        value, error = convert_parameter(raw, props.get(key))
        if error is not None:
            kind = props.get(key, {}).get("type")
            return failed(f"parameter {key!r} of {name!r} (schema type {kind!r}) {error}", name)
        arguments[key] = value
    return ToolCall(name=name, arguments=arguments)


def split_blocks(text: str, open_tag: str, close_tag: str) -> tuple[list[str], list[str], str | None]:
    """Text outside the `open_tag ... close_tag` blocks, the blocks' bodies, and the body of an unclosed
    last block (cut off by the token limit), or None."""
    outside: list[str] = []
    bodies: list[str] = []
    pos = 0
    while (start := text.find(open_tag, pos)) >= 0:
        outside.append(text[pos:start])
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return outside, bodies, text[start + len(open_tag):]
        bodies.append(text[start + len(open_tag):end])
        pos = end + len(close_tag)
    outside.append(text[pos:])
    return outside, bodies, None


def unclosed(open_tag: str, close_tag: str, body: str, name: str = "") -> ToolCall:
    return failed(f"unclosed {open_tag} block (no {close_tag}; was the generation truncated?): {shown(body)}", name)


def drop_reasoning(text: str, close_tag: str = "</think>", open_tag: str = "<think>") -> str:
    """The text without its reasoning: everything up to the first `close_tag` (the prompt may have opened
    the block already, so the open tag is optional). Calls written while reasoning are not calls."""
    cut = text.find(close_tag)
    if cut >= 0:
        return text[cut + len(close_tag):]
    start = text.find(open_tag)
    return text if start < 0 else text[:start]  # reasoning cut off by the token limit: no answer yet
