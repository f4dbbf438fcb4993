"""Rule-based reward for the calculator-tool task (data_source "rlsp/calculator_problems").

Only the model's final answer counts. In a multi-turn rollout `solution_str` is the whole trajectory,
tool output included, so the correct number is in the text as soon as the calculator has answered:
scoring the text would pay for a call without an answer. The scorer therefore reads
`extra_info["messages"]` (the prompt's messages followed by the rollout's assistant and tool
messages, as the agent loop reports them) and takes the LAST message with role "assistant": its
content, with tool-call blocks already removed by the loop. Without messages (a single-turn rollout,
or a caller that passes none) it falls back to `solution_str` itself.

Score: 1.0 when the last integer of that text (thousands separators allowed: "1,913,937") equals the
ground truth; else `FORMAT_SCORE` (0.1) when the trajectory made a tool call that was evaluated
(`extra_info["tool_calls"]` holds one without a session error whose response is not the calculator's
"Error: ..." refusal); else 0.0. Validation accuracy counts only 1.0.
Why the credit (measured on 24 training problems x 8 samples of the untrained SmolLM2-135M-Instruct,
recipes/grpo_tool_calculator_cpu/README.md): without it almost no word-problem group has samples with
different rewards (1 of 18 at temperature 0.3, 0 of 18 at 0.7), so GRPO gets no signal to start calling
the tool on them; with a credit for every call the session ran 5 and 6 of 18 do (the reward also
excludes refusals, so that a call with a wrong parameter name earns nothing). GRPO divides by the
group's reward spread, so any small value gives a {0, credit} group the same push towards calling; in
groups that also hold a correct answer a small value keeps the correct answer well ahead of a call.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rlsp.rewards.arithmetic import clean_response
from rlsp.rewards.registry import register_reward

DATA_SOURCE = "rlsp/calculator_problems"
CORRECT_SCORE = 1.0
FORMAT_SCORE = 0.1
_INTEGER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+")
_TOOL_BLOCK = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.DOTALL)


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (commas as thousands separators allowed), or None."""
    found = _INTEGER.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def final_answer_text(messages: Sequence[dict[str, Any]] | None, solution_str: str) -> str:
    """The content of the last assistant message; `solution_str` (cleaned) when there are no messages."""
    if messages:
        for message in reversed(list(messages)):
            if isinstance(message, dict) and message.get("role") == "assistant":
                return str(message.get("content") or "")
        return ""
    # Single-turn fallback: a tool-call block is not an answer even when the text holds one.
    return _TOOL_BLOCK.sub("", clean_response(solution_str))


def made_good_call(extra_info: dict[str, Any] | None) -> bool:
    """Whether the trajectory's tool calls include one that was evaluated: no session error (bad JSON, unknown
    tool, timeout) and a response that is not the tool's own refusal ("Error: ...", e.g. a wrong parameter name)."""
    calls = (extra_info or {}).get("tool_calls") or []
    return any(isinstance(c, dict) and not c.get("error") and not str(c.get("response", "")).startswith("Error")
               for c in calls)


def score_final_answer(answer_text: str, ground_truth: str) -> float:
    """1.0 when the last integer of `answer_text` equals the integer `ground_truth`, else 0.0."""
    try:
        truth = int(str(ground_truth).strip().replace(",", ""))
    except ValueError:
        raise ValueError(f"ground_truth {ground_truth!r} is not an integer; the calculator task needs one") from None
    return CORRECT_SCORE if last_integer(answer_text) == truth else 0.0


@register_reward(DATA_SOURCE)
def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """Score one rollout of the calculator task (see the module docstring)."""
    messages = (extra_info or {}).get("messages")
    score = score_final_answer(final_answer_text(messages, solution_str), ground_truth)
    if score == 0.0 and FORMAT_SCORE and made_good_call(extra_info):
        return FORMAT_SCORE
    return score
