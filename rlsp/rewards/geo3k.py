"""Rule reward for Geometry3K (data_source "hiyouga/geometry3k"), verl's geo3k rule.

score = 0.9 * accuracy + 0.1 * format, where accuracy is 1 when the last `\\boxed{}` of the response equals the
ground truth after rlsp's math normalisation (rlsp.rewards.math.is_equivalent: "2\\sqrt{3}" vs "2 \\sqrt 3",
"0.5" vs "\\frac{1}{2}"), and format is 1 when the whole response reads `<think>...</think>...\\boxed{...}...`
(the reasoning in think tags, then a boxed answer). Scores: 1.0, 0.9 (right, unformatted), 0.1 (formatted,
wrong), 0.0.
"""

from __future__ import annotations

import re

from rlsp.data.answers import last_boxed
from rlsp.data.vision_geo3k import GEO3K_SOURCE
from rlsp.rewards.math import is_equivalent
from rlsp.rewards.registry import register_reward

FORMAT_WEIGHT = 0.1
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_score(response: str) -> float:
    return 1.0 if _FORMAT.fullmatch(response.strip()) else 0.0


def accuracy_score(response: str, ground_truth: str) -> float:
    boxed = last_boxed(response)
    return 1.0 if boxed is not None and is_equivalent(boxed, str(ground_truth)) else 0.0


@register_reward(GEO3K_SOURCE)
def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """verl's geo3k score of one response (see the module docstring)."""
    return (1.0 - FORMAT_WEIGHT) * accuracy_score(solution_str, ground_truth) + FORMAT_WEIGHT * format_score(solution_str)
