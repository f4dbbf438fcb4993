"""`Gsm8kTool`: an answer checker for GSM8K problems that the model calls before it commits to a final answer.

This is the tool of verl's GSM8K multi-turn example (tool YAML `class_name: verl.tools.gsm8k_tool.Gsm8kTool`,
function name `calc_gsm8k_reward`, one string parameter `answer`); rlsp.agent.tools.loading maps that class
name here. Each trajectory's instance is created with the row's ground truth
(`extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`, as `rlsp.data.preprocess
gsm8k_multiturn` writes it). A call submits an answer: it is scored by rlsp's GSM8K rule
(rlsp.rewards.gsm8k, flexible extraction: the last number), and the model is told the parsed answer and its
score. The step reward is 0.0 when the score beats the instance's best so far (which starts at 0.0) and
`resubmit_penalty` (-0.05) otherwise, so repeating an answer that does not improve costs a little.
`calc_reward` is the score of the latest submission (0.0 before any).
"""

from __future__ import annotations

from typing import Any

from rlsp.agent.tools.base import BaseTool, ToolResponse
from rlsp.data.preprocess import GSM8K_TOOL_NAME
from rlsp.rewards.gsm8k import extract_answer, score_gsm8k

TOOL_NAME = GSM8K_TOOL_NAME  # the name the preprocessed rows' tools_kwargs use
ANSWER_PREFIX = "#### "
RESUBMIT_PENALTY = -0.05
GSM8K_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Check a final answer to the GSM8K problem: returns 1.0 when it is right, 0.0 when not.",
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {"type": "string", "description": "The final numeric answer, digits only (e.g. 72)"},
            },
            "required": ["answer"],
        },
    },
}


def as_submission(answer: Any) -> str:
    """The model's `answer` as the response that is scored: text, starting with "#### " unless it already does."""
    text = answer if isinstance(answer, str) else str(answer)
    return text if text.lstrip().startswith(ANSWER_PREFIX.strip()) else f"{ANSWER_PREFIX}{text}"


def _ground_truth(ground_truth: Any, create_kwargs: Any) -> str:
    """The ground truth from either creation form: `create(ground_truth=...)` (rlsp's ToolSession, older verl)
    or `create(create_kwargs={"ground_truth": ...})` (newer verl)."""
    if create_kwargs is not None:
        if not isinstance(create_kwargs, dict):
            raise ValueError(f"Gsm8kTool.create: create_kwargs must be a mapping {{'ground_truth': ...}}, "
                             f"got {type(create_kwargs).__name__}: {create_kwargs!r}")
        if ground_truth is None:
            ground_truth = create_kwargs.get("ground_truth")
    if ground_truth is None:
        raise ValueError("Gsm8kTool.create needs the problem's answer: pass ground_truth=... or "
                         "create_kwargs={'ground_truth': ...} (a data row's extra_info.tools_kwargs."
                         f"{TOOL_NAME}.create_kwargs.ground_truth)")
    return str(ground_truth)


def _penalty(config: dict[str, Any]) -> float:
    value = config.get("resubmit_penalty", RESUBMIT_PENALTY)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"Gsm8kTool config resubmit_penalty={value!r}: must be a number (default {RESUBMIT_PENALTY})")
    return float(value)


class Gsm8kTool(BaseTool):
    """Scores submitted GSM8K answers against the instance's ground truth (see the module docstring).

    Config: `resubmit_penalty` (default -0.05), the step reward of a submission that does not beat the
    instance's best score so far. verl's `config.type: native` is accepted and ignored.
    """

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema if tool_schema is not None else GSM8K_TOOL_SCHEMA)
        self.resubmit_penalty = _penalty(self.config)

    async def create(self, instance_id: str | None = None, ground_truth: Any = None,
                     create_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start an instance for one problem; its ground truth comes as `ground_truth` or inside `create_kwargs`."""
        truth = _ground_truth(ground_truth, create_kwargs)
        instance_id, response = await super().create(instance_id)
        self.state(instance_id).update(ground_truth=truth, response="", score=0.0, best=0.0)
        return instance_id, response

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse | str, float, dict[str, Any]]:
        """Score `parameters["answer"]`; the text names the parsed answer and its score."""
        state = self.state(instance_id)
        submission = as_submission(parameters.get("answer", ""))
        score = score_gsm8k(submission, state["ground_truth"], method="flexible")
        step_reward = 0.0 if score > state["best"] else self.resubmit_penalty
        state.update(response=submission, score=score, best=max(state["best"], score))
        parsed = extract_answer(submission, method="flexible")
        text = f"Parsed answer: {parsed if parsed is not None else '(no number found)'}; reward: {score}"
        return ToolResponse(text=text), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The score of the instance's latest submission (0.0 when it submitted nothing)."""
        return float(self.state(instance_id)["score"])
