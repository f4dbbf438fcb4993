"""gpt-oss (OpenAI harmony): one assistant turn is a sequence of channel messages.

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

(the generation prompt already wrote the first `<|start|>assistant`). `analysis` messages are reasoning:
not content, and a call written in one is not a call. A message addressed `to=functions.NAME` (in the
header before or after the channel) with a JSON body ended by `<|call|>` is a call; `final` messages,
and `commentary` messages to no one (preambles), are the content, joined by newlines. A call message
that stops without `<|call|>` was cut off (or malformed) and is returned with `error` set. The model
stops at `<|call|>` after a call and at `<|return|>` after its answer: both are stop tokens of the format.
"""

from __future__ import annotations

import re

from rlsp.agent.formats.common import ParameterSchemas, failed, json_arguments, shown
from rlsp.agent.types import ToolCall

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
STOP_TOKENS = (CALL, RETURN)
FUNCTIONS = "functions."
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_TERMINATOR = re.compile("|".join(re.escape(t) for t in (END, CALL, RETURN)))


def _call(recipient: str, body: str, terminator: str | None) -> ToolCall:
    if not recipient.startswith(FUNCTIONS) or len(recipient) == len(FUNCTIONS):
        return failed(f"message to {recipient!r}: only function tools ({FUNCTIONS}NAME) can be called")
    name = recipient[len(FUNCTIONS):]
    if terminator != CALL:
        how = "no end (was the generation truncated?)" if terminator is None else f"{terminator} instead of {CALL}"
        return failed(f"the call of {name!r} has {how}: {shown(body)}", name)
    arguments, error = json_arguments(body) if body.strip() else ({}, None)
    return ToolCall(name=name, arguments=arguments, error=error)


def parse(text: str, schemas: ParameterSchemas | None = None) -> tuple[str, list[ToolCall]]:
    content: list[str] = []
    calls: list[ToolCall] = []
    for chunk in text.split(START):
        header, sep, rest = chunk.partition(MESSAGE)
        recipient = _RECIPIENT.search(header)
        if not sep:
            if recipient:  # cut off inside a call's header
                calls.append(failed(f"the call header {shown(header)} has no {MESSAGE} (was the generation "
                                    "truncated?)"))
            elif CHANNEL not in header and header.strip():
                content.append(header.strip())  # text outside any message
            continue
        found = _TERMINATOR.search(rest)
        body, terminator = (rest[:found.start()], found.group(0)) if found else (rest, None)
        channel = _CHANNEL.search(header)
        if channel is not None and channel.group(1) == "analysis":
            continue
        if recipient:
            calls.append(_call(recipient.group(1), body, terminator))
        elif body.strip():
            content.append(body.strip())
    return "\n".join(content), calls
