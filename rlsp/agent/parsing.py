"""Tool calls parsed from an assistant turn's text, one parser per tool-call format (rlsp.agent.formats).

`parse_tool_calls(text, fmt, tools)` returns the assistant's content with the tool-call blocks removed and
the calls in the order written. A call that cannot be used as written (malformed JSON, no name, arguments
that are not an object, a parameter value its schema type cannot read, a block cut off by the token limit)
is still returned, with `error` set, so the agent loop can answer it with an error observation instead of
silently dropping it (verl drops such calls or passes them on raw). Reasoning the format marks as such
(gpt-oss's analysis channel; the `<think>` blocks of glm, seed and deepseek_v4) is not content, and calls
written inside it are not calls.

Formats (`rlsp.config.choices.TOOL_CALL_FORMATS`, `multi_turn.format`; verl's names), each in its module
under rlsp/agent/formats/: hermes, gpt-oss, qwen3_coder, glm, seed, minimax, kimi, deepseek_v4, gemma4.
The XML-parameter formats (qwen3_coder, glm, seed, minimax, deepseek_v4 without a string marker) write
values as bare text: with `tools` (OpenAI function schemas) each value is read as its parameter's schema
type, without them it is JSON when it parses, else the text.

Why not transformers' own response parser: transformers 5 has `tokenizer.parse_response(text,
prefix=...)`, but it only runs on tokenizers whose files carry a `response_template` (or with such a
schema passed in); the chat templates rlsp trains with mostly carry none. It also raises on the first
malformed JSON block for the whole response, where an RL rollout needs a per-call error to feed back.
So the parsers here are plain text parsers, independent of the tokenizer.
"""

from __future__ import annotations

from rlsp.agent.formats import parameter_schemas, tool_format
from rlsp.agent.types import ToolCall


def parse_tool_calls(text: str, fmt: str = "hermes", tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    """The content of an assistant turn without its tool-call blocks (stripped), and the calls in order.

    Calls that cannot be used carry `error` (and `arguments=None`); `name` is kept when it was readable.
    `tools`: the OpenAI function schemas of the tools, to read XML parameter values by type.
    """
    return tool_format(fmt).parse(text, parameter_schemas(tools) if tools else None)
