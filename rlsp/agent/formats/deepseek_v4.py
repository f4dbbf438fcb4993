"""deepseek_v4 (DeepSeek-V4 DSML): invokes inside a `<｜DSML｜tool_calls>` block, after the reasoning.

    </think>Let me look.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`string="true"` marks the raw text as the value, `string="false"` a JSON value (an error when it is not
JSON); a parameter without the attribute is read by the tool's schema. Text up to `</think>` is
reasoning, not content. Turns end with `<｜end▁of▁sentence｜>`: no extra stop token.
"""

from __future__ import annotations

import json
from typing import Any

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
from rlsp.agent.formats.minimax import InvokeTags, invoke_calls
from rlsp.agent.types import ToolCall

DSML = "｜DSML｜"
OPEN, CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
TAGS = InvokeTags(f"<{DSML}invoke", f"</{DSML}invoke>", f"<{DSML}parameter", f"</{DSML}parameter>")
EOS = "<｜end▁of▁sentence｜>"


def _maker(schemas: ParameterSchemas | None):  # noqa: ANN202 -- a MakeCall closure
    def make(name: str, params: list[tuple[dict[str, str], str]], body: str) -> ToolCall:
        typed = [(attrs["name"], text) for attrs, text in params if attrs.get("string") not in ("true", "false")]
        call = typed_call(name, typed, schemas, body)
        if call.error is not None:
            return call
        arguments: dict[str, Any] = {}
        for attrs, text in params:
            key, marker = attrs["name"], attrs.get("string")
            if key in arguments:
                return failed(f"parameter {key!r} is given twice in the call of {name!r}: {shown(body)}", name)
            if marker == "true":
                arguments[key] = text
            elif marker == "false":
                try:
                    arguments[key] = json.loads(text)
                except json.JSONDecodeError as exc:
                    return failed(f"parameter {key!r} of {name!r} is marked string=\"false\" but is not JSON "
                                  f"({exc.msg}): {shown(text)}", name)
            else:
                arguments[key] = call.arguments[key]
        return ToolCall(name=name, arguments=arguments)

    return make


def parse(text: str, schemas: ParameterSchemas | None = None) -> tuple[str, list[ToolCall]]:
    outside, bodies, cut = split_blocks(drop_reasoning(text.replace(EOS, "")), OPEN, CLOSE)
    make = _maker(schemas)
    scan = Scan(outside, [call for body in bodies for call in invoke_calls(body, TAGS, make)])
    if cut is not None:
        scan.calls.append(unclosed(OPEN, CLOSE, cut))
    return scan.result()
