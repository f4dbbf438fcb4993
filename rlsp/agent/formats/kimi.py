"""kimi (Kimi K2): special-token calls inside a tool-calls section, each with a call id and JSON arguments.

    Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The id is `functions.NAME:INDEX`; the name is read from it. The model writes `<|im_end|>` after the section
(its template renders a calling turn that way), so the turn ends with the template's end-of-turn: no
extra stop token (stopping at the section end would leave the turn without the end-of-turn token that the
observation ids follow).
"""

from __future__ import annotations

import re

from rlsp.agent.formats.common import ParameterSchemas, Scan, failed, json_arguments, shown, split_blocks, unclosed
from rlsp.agent.types import ToolCall

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGUMENTS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_ID = re.compile(r"(?:functions\.)?([^\s:]+)(?::\d+)?")


def _call(body: str) -> ToolCall:
    call_id, sep, raw = body.partition(ARGUMENTS)
    match = _ID.fullmatch(call_id.strip())
    name = match.group(1) if match else ""
    if not sep or not name:
        return failed(f"tool call is not {CALL}functions.NAME:INDEX{ARGUMENTS}{{json}}{CALL_END}: {shown(body)}", name)
    arguments, error = json_arguments(raw) if raw.strip() else ({}, None)
    return ToolCall(name=name, arguments=arguments, error=error)


def _section(body: str, closed: bool) -> list[ToolCall]:
    _, calls, cut = split_blocks(body, CALL, CALL_END)
    out = [_call(call) for call in calls]
    if cut is not None:
        out.append(unclosed(CALL, CALL_END, cut, _call(cut).name if ARGUMENTS in cut else ""))
    elif not closed:
        out.append(unclosed(SECTION, SECTION_END, body))
    return out


def parse(text: str, schemas: ParameterSchemas | None = None) -> tuple[str, list[ToolCall]]:
    outside, bodies, cut = split_blocks(text, SECTION, SECTION_END)
    scan = Scan(outside, [call for body in bodies for call in _section(body, True)])
    if cut is not None:
        scan.calls.extend(_section(cut, False))
    return scan.result()
