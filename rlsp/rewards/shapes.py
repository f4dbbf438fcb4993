"""Rule reward for the synthetic shapes task (data_source "rlsp/shapes", rlsp.data.tasks.shapes).

The response is cleaned as the arithmetic task's is (trailing end-of-turn/pad tokens and whitespace stripped),
lowercased, and a trailing period dropped. The ground truth is a colour name ("colour" questions) or a count
("count" questions). Shaping tiers, as for the arithmetic task:
- 1.0  exactly the answer ("red", "Red.", "3");
- 0.5  starts with the answer, more text follows ("red square", "3 squares"): right, not yet stopping;
- 0.1  exactly a well-formed answer of the question's kind, the wrong one ("blue" for red, "2" for 3);
- up to 0.05  colour questions: the response begins with the first letters of the right colour name ("re", "rxq"
       for red), 0.05 x the share of the name written: the rung a random-init policy can reach first. A count's
       first digit is already its whole answer; a colour name takes 3-6 characters, which a policy that writes
       one character of a letter-level vocabulary at random (1 in 64) never spells, so without this rung every
       response of such a policy scores 0 and GRPO has no signal (measured: a random-init Qwen2.5-VL with rlsp's
       character tokenizer, 48 GRPO steps, reward 0.0 on every one);
- 0.0  anything else.
"""

from __future__ import annotations

from rlsp.data.tasks.shapes import COLOURS, DATA_SOURCE
from rlsp.rewards.arithmetic import clean_response
from rlsp.rewards.registry import register_reward

CORRECT_SCORE = 1.0
CORRECT_WITH_TRAILING_SCORE = 0.5
FORMAT_SCORE = 0.1
PREFIX_SCORE = 0.05


def _well_formed(text: str, ground_truth: str) -> bool:
    """Whether `text` is an answer of the same kind as the ground truth (a count, or a colour name)."""
    return text.isdigit() if ground_truth.isdigit() else text in COLOURS


def score_shapes(solution_str: str, ground_truth: str) -> float:
    """Score one response against the ground truth (see the module docstring)."""
    text = clean_response(solution_str).lower()
    text = text[:-1].rstrip() if text.endswith(".") else text
    truth = ground_truth.strip().lower()
    if not truth:
        raise ValueError("shapes reward: empty ground_truth; legal: a colour name or a count")
    if truth.isdigit() and text.isdigit():  # a number alone: right or wrong, never "starts with" ("30" for 3)
        return CORRECT_SCORE if int(text) == int(truth) else FORMAT_SCORE
    if text == truth:
        return CORRECT_SCORE
    if text.startswith(truth):
        return CORRECT_WITH_TRAILING_SCORE
    if _well_formed(text, truth):
        return FORMAT_SCORE
    return PREFIX_SCORE * _common_prefix(text, truth) / len(truth) if not truth.isdigit() else 0.0


def _common_prefix(text: str, truth: str) -> int:
    """How many leading characters of `text` spell the start of `truth`."""
    n = 0
    while n < min(len(text), len(truth)) and text[n] == truth[n]:
        n += 1
    return n


@register_reward(DATA_SOURCE)
def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Score one response of the shapes task."""
    return score_shapes(solution_str, ground_truth)
