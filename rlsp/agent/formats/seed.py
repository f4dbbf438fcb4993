"""seed (ByteDance Seed-OSS): Qwen3-Coder's XML calls inside `<seed:tool_call>` blocks, after a
`<seed:think>` reasoning block that is not content (calls written while reasoning are not calls).

    <seed:think>...</seed:think>Let me look.<seed:tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    </function>
    </seed:tool_call>

Turns end with the template's end-of-turn (`<seed:eos>`): no extra stop token.
"""

from __future__ import annotations

from rlsp.agent.formats.common import ParameterSchemas, Scan, drop_reasoning, split_blocks, unclosed
from rlsp.agent.formats.qwen3_coder import function_calls, function_name
from rlsp.agent.types import ToolCall

OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"
THINK, THINK_END = "<seed:think>", "</seed:think>"


def parse(text: str, schemas: ParameterSchemas | None = None) -> tuple[str, list[ToolCall]]:
    outside, bodies, cut = split_blocks(drop_reasoning(text, THINK_END, THINK), OPEN, CLOSE)
    scan = Scan(outside, [call for body in bodies for call in function_calls(body, schemas)])
    if cut is not None:
        scan.calls.append(unclosed(OPEN, CLOSE, cut, function_name(cut)))
    return scan.result()
