"""Final-answer extraction shared by preprocessing (ground truths) and the rule scorers.

- gsm8k marks the final answer with a line `#### <number>`; `hash_answers` lists those numbers.
- MATH puts it in `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5` without braces); `last_boxed`
  returns the content of the last one, matching nested braces.
"""

from __future__ import annotations

import re

_HASH_ANSWER = re.compile(r"####\s*(-?\s*\$?\s*-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def hash_answers(text: str) -> list[str]:
    """Every number written after `####`, in order (raw text: may hold `$`, commas, spaces after a minus)."""
    return _HASH_ANSWER.findall(text)


def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at `text[start] == "{"`, or None when it is never closed."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed x` in `text`; None when there is none."""
    pos = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if pos < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, pos))
    rest = pos + len(cmd)
    if rest < len(text) and text[rest] == " ":  # "\boxed 5": the argument is the next word
        word = text[rest + 1 :].split("$")[0].split()
        return word[0] if word else None
    if rest < len(text) and text[rest] == "{":
        return _braced(text, rest)
    return None
