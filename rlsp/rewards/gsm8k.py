"""Rule reward for GSM8K-format data (data_source "openai/gsm8k"): the number after `####`.

Two extraction methods, as verl has them:
- strict (the registered default): the *last* `#### <number>` of the response; a response that
  never writes `####` gets nothing, so the format is part of what is learned;
- flexible: the last number anywhere in the response.
Numbers are compared after normalisation: `$`, thousands commas, a sentence-final period and
trailing fractional zeros are dropped ("#### $1,200.00" equals "1200"), so the comparison is on the
value as written, not on its formatting. Score: `score` (1.0) when equal, `format_score` (0.0 by
default) for a well-formed but wrong answer, 0.0 when nothing is extracted.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from rlsp.data.answers import hash_answers
from rlsp.rewards.registry import register_reward

DATA_SOURCE = "openai/gsm8k"
METHODS = ("strict", "flexible")
# Trailing special tokens when a response was decoded without skipping them.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")
_ANY_NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+")


def normalize_number(text: str) -> str | None:
    """Canonical text of a number ("1,200.50" -> "1200.5", "-$3" -> "-3", "7." -> "7"); None if not one."""
    cleaned = re.sub(r"[\s$,]", "", text).rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The normalised final answer of a response by `method` (see the module docstring), or None."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}; legal: {list(METHODS)}")
    for token in END_TOKENS:
        solution_str = solution_str.replace(token, " ")
    candidates = hash_answers(solution_str) if method == "strict" else _ANY_NUMBER.findall(solution_str)
    for raw in reversed(candidates):
        number = normalize_number(raw)
        if number is not None:
            return number
    return None


def score_gsm8k(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == normalize_number(str(ground_truth)) else format_score


@register_reward(DATA_SOURCE)
def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Strict `####` extraction, 1.0 for the right number, else 0.0."""
    return score_gsm8k(solution_str, ground_truth, method="strict")
