"""Rule-based reward for the synthetic arithmetic task (data_source "rlsp/arithmetic").

The response text is first cleaned: trailing end-of-turn/pad tokens (`<|im_end|>`, `<|endoftext|>`,
`<|pad|>`, present when decoded without skipping special tokens) and surrounding whitespace are
stripped. Shaping, so that a random-init policy gets a learning signal at every stage:
- 1.0  exactly the correct integer ("7", " 7 ", "7<|im_end|>", "07");
- 0.5  starts with the correct answer but more text follows ("7 apples", "7xq", "777"): the answer
       is right, the model has yet to learn to stop;
- 0.1  exactly an integer, the wrong one ("8", "87"): a well-formed answer;
- 0.0  anything else: empty, no leading integer ("=7"), a wrong number followed by text ("8 apples").
Why these tiers (measured with GRPO on the tiny model): crediting a wrong *leading* integer followed
by junk made "33333333" a stable 0.1 plateau where the policy never learned to stop; comparing the
response *prefix* with the answer for the 0.5 tier lets a policy that has not learned to stop yet
still get credit for the right first digits.
"""

from __future__ import annotations

import re

from rlsp.rewards.registry import register_reward

DATA_SOURCE = "rlsp/arithmetic"
CORRECT_SCORE = 1.0
CORRECT_WITH_TRAILING_SCORE = 0.5
FORMAT_SCORE = 0.1
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|pad|>")
_LEADING_INT = re.compile(r"[+-]?\d+")


def clean_response(solution_str: str) -> str:
    """Strip trailing end-of-turn/pad tokens and surrounding whitespace from a response."""
    text = solution_str.strip()
    while True:
        token = next((t for t in END_TOKENS if text.endswith(t)), None)
        if token is None:
            return text.lstrip()
        text = text[: -len(token)].rstrip()


def score_answer(text: str, ground_truth: str) -> float:
    """Score a cleaned response against the integer ground truth (see the module docstring)."""
    truth = ground_truth.strip()
    match = _LEADING_INT.match(text)
    if match is None:
        return 0.0
    if match.end() == len(text) and int(match.group()) == int(truth):
        return CORRECT_SCORE
    if text.startswith(truth):
        return CORRECT_WITH_TRAILING_SCORE
    return FORMAT_SCORE if match.end() == len(text) else 0.0


@register_reward(DATA_SOURCE)
def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """Score one response of the arithmetic task."""
    return score_answer(clean_response(solution_str), ground_truth)
