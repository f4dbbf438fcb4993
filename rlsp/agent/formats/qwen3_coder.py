"""qwen3_coder (Qwen3-Coder, Qwen3.5): XML parameters inside `<tool_call>` blocks.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each value is the text between the parameter tags less one leading and one trailing newline, read by the
tool's schema (rlsp.agent.formats.common.convert_parameter). Turns end with `<|im_end|>`: no extra stop token.
"""

from __future__ import annotations

from rlsp.agent.formats.common import ParameterSchemas, Scan, failed, shown, split_blocks, typed_call, unclosed
from rlsp.agent.types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def _one_newline_off(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def function_name(body: str) -> str:
    """The `<function=NAME>` of a (possibly cut-off) block, or "" when it is not there."""
    start = body.find(FUNCTION)
    end = body.find(">", start + len(FUNCTION)) if start >= 0 else -1
    return body[start + len(FUNCTION):end].strip() if end >= 0 else ""


def function_call(body: str, schemas: ParameterSchemas | None) -> ToolCall:
    """`<function=NAME><parameter=K>V</parameter>...</function>` as a ToolCall."""
    name = function_name(body)
    if not name:
        return failed(f"tool call has no {FUNCTION}NAME> header: {shown(body)}")
    start = body.find(">", body.find(FUNCTION) + len(FUNCTION)) + 1
    end = body.find(FUNCTION_END, start)
    if end < 0:
        return failed(f"the call of {name!r} has no {FUNCTION_END}: {shown(body)}", name)
    pairs: list[tuple[str, str]] = []
    inner, pos = body[start:end], 0
    while (p := inner.find(PARAMETER, pos)) >= 0:
        head_end = inner.find(">", p)
        close = inner.find(PARAMETER_END, head_end + 1) if head_end >= 0 else -1
        if close < 0:
            return failed(f"a parameter of {name!r} has no {PARAMETER_END}: {shown(inner[p:])}", name)
        pairs.append((inner[p + len(PARAMETER):head_end].strip(), _one_newline_off(inner[head_end + 1:close])))
        pos = close + len(PARAMETER_END)
    return typed_call(name, pairs, schemas, body)


def function_calls(block: str, schemas: ParameterSchemas | None) -> list[ToolCall]:
    """Every `<function=...>` of one block, in order (a block without one is one failed call)."""
    starts = [i for i in range(len(block)) if block.startswith(FUNCTION, i)]
    if not starts:
        return [function_call(block, schemas)]
    return [function_call(block[a:b], schemas) for a, b in zip(starts, [*starts[1:], len(block)])]


def parse(text: str, schemas: ParameterSchemas | None = None) -> tuple[str, list[ToolCall]]:
    outside, bodies, cut = split_blocks(text, OPEN, CLOSE)
    scan = Scan(outside, [call for body in bodies for call in function_calls(body, schemas)])
    if cut is not None:
        scan.calls.append(unclosed(OPEN, CLOSE, cut, function_name(cut)))
    return scan.result()
