"""The tool-call formats (`actor_rollout_ref.rollout.multi_turn.format`, verl's names): one module per format
and this registry.

Each format has a parser, text -> (content without the call blocks, calls in order), and the stop tokens
the loop must end a turn at besides the chat template's end-of-turn (gpt-oss's `<|call|>`, Gemma 4's
`<tool_call|>`, GLM's `<|observation|>`): a generation that runs past one is cut right after it (what
the engine would have returned had it stopped there), and the first one is where a calling turn ends, so
the observation ids start after it. The contract of the parsers is rlsp.agent.parsing's.
`check_chat_template` asks the template, once, what the loop will ask of it under a format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlsp.agent.formats import deepseek_v4, gemma4, glm, gpt_oss, hermes, kimi, minimax, qwen3_coder, seed
from rlsp.agent.formats.common import ParameterSchemas, parameter_schemas
from rlsp.agent.types import ToolCall
from rlsp.config.choices import TOOL_CALL_FORMATS

Parser = Callable[[str, ParameterSchemas | None], tuple[str, list[ToolCall]]]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parse: Parser
    stop_tokens: tuple[str, ...] = ()  # token strings that end a turn, besides the template's end-of-turn


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", hermes.parse),
    ToolFormat("gpt-oss", gpt_oss.parse, gpt_oss.STOP_TOKENS),
    ToolFormat("qwen3_coder", qwen3_coder.parse),
    ToolFormat("glm", glm.parse, glm.STOP_TOKENS),
    ToolFormat("seed", seed.parse),
    ToolFormat("minimax", minimax.parse),
    ToolFormat("kimi", kimi.parse),
    ToolFormat("deepseek_v4", deepseek_v4.parse),
    ToolFormat("gemma4", gemma4.parse, gemma4.STOP_TOKENS),
)}
assert tuple(FORMATS) == TOOL_CALL_FORMATS, (tuple(FORMATS), TOOL_CALL_FORMATS)


def tool_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; legal formats: {list(TOOL_CALL_FORMATS)}")
    return FORMATS[name]


def stop_token_ids(name: str, tokenizer: Any) -> set[int]:
    """The ids of format `name`'s stop tokens in `tokenizer`; a stop token the tokenizer lacks as one token
    is an error (the model could not write it as one, and the loop could not see where the call ends)."""
    ids = set()
    for token in tool_format(name).stop_tokens:
        found = tokenizer.convert_tokens_to_ids(token)
        unk = getattr(tokenizer, "unk_token_id", None)
        if not isinstance(found, int) or found < 0 or (found == unk and token != getattr(tokenizer, "unk_token", None)):
            raise ValueError(f"multi_turn.format={name!r} needs the stop token {token!r}, which tokenizer "
                             f"{type(tokenizer).__name__} does not have as one token; use the format of the "
                             f"model's family (legal formats: {list(TOOL_CALL_FORMATS)})")
        ids.add(found)
    return ids


_PROBE = "probe_tool"


def check_chat_template(name: str, tokenizer: Any, chat: Any) -> None:
    """What the loop will ask of the template under format `name`, asked once (rlsp.check, start-up): the
    format's stop tokens are tokens of `tokenizer`, and `chat` (rlsp.agent.chat.ChatTokens) renders a tool
    result after a calling turn that ends as the format ends it (its first stop token, else the template's
    end-of-turn). Raises ValueError / RuntimeError naming what does not fit."""
    stop_token_ids(name, tokenizer)
    stops = tool_format(name).stop_tokens
    end = tokenizer.convert_tokens_to_ids(stops[0]) if stops else None
    call = {"type": "function", "function": {"name": _PROBE, "arguments": {}}}
    chat.observation_ids([{"role": "tool", "name": _PROBE, "content": "0"}], [call], end_id=end)


__all__ = ["FORMATS", "ToolFormat", "check_chat_template", "parameter_schemas", "stop_token_ids", "tool_format"]
