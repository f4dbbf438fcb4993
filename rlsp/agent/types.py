"""Small records shared by the agent modules (tool calls parsed from model text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model wrote: the tool's name and its arguments (a JSON object).

    `error` says why the call could not be used as written (malformed JSON, arguments that are not an
    object, no name); then `arguments` is None and the call is answered with an error observation."""

    name: str
    arguments: dict[str, Any] | None
    error: str | None = None
