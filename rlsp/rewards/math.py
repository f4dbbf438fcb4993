"""Rule reward for MATH-style data: the last `\\boxed{...}` of the response against the ground truth.

Data sources: "DigitalLearningGmbH/MATH-lighteval" (what `rlsp.data.preprocess math` writes) and
"lighteval/MATH". Both answers are normalised before comparison (`normalize_answer`), in this order:
spacing commands (`\\!`, `\\,`, `\\;`, `\\quad`), `\\left`/`\\right`, `\\dfrac`/`\\tfrac` -> `\\frac`,
degrees, `$`, percent signs, trailing units (`\\text{ cm}`, "5 inches", "\\mbox{dollars}"),
remaining `\\text{...}` wrappers, a leading "x =" , thousands commas ("1,000"), all whitespace,
braceless fractions/roots (`\\frac12` -> `\\frac{1}{2}`, `\\sqrt3` -> `\\sqrt{3}`), integer `a/b` ->
`\\frac{a}{b}`, a leading-dot decimal (".5" -> "0.5") and trailing fractional zeros ("2.50" ->
"2.5", "3.0" -> "3"). Strings still different are compared as exact rationals when both are plain
numbers or fractions, so "0.5", "\\frac{1}{2}" and "1/2" all agree. Score 1.0 or 0.0.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rlsp.data.answers import last_boxed
from rlsp.rewards.registry import register_reward

DATA_SOURCES = ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH")
UNIT_WORDS = (
    "units", "unit", "cm", "centimeters", "meters", "km", "kilometers", "mm", "inches", "inch", "feet",
    "foot", "ft", "yards", "miles", "mph", "degrees", "degree", "dollars", "dollar", "cents", "cent", "hours",
    "hour", "minutes", "minute", "seconds", "second", "days", "day", "square", "sq", "cubic",
)
_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "~")
_UNIT_TEXT = re.compile(r"^(.*?\S)\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z][a-zA-Z ^2]*\}$")
_UNIT_WORD = re.compile(r"^(.*?[0-9}])\s*(?:" + "|".join(UNIT_WORDS) + r")(?:\^?[23])?$")
_TEXT_WRAP = re.compile(r"\\(?:text|mbox|mathrm|textbf)\{([^{}]*)\}")
_LHS = re.compile(r"^[a-zA-Z]\s*=\s*(?!=)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_BRACELESS_FRAC = re.compile(r"\\frac(\d)(\d)")
_HALF_BRACED_FRAC = re.compile(r"\\frac(\d)(?=\{)|\\frac(\{[^{}]*\})(\d)")
_BRACELESS_SQRT = re.compile(r"\\sqrt(\w)")
_INT_SLASH = re.compile(r"^(-?\d+)/(\d+)$")
_TRAILING_ZEROS = re.compile(r"^(-?\d+)\.(\d*?)0+$")
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")


def _strip_units(text: str) -> str:
    for pattern in (_UNIT_TEXT, _UNIT_WORD):
        match = pattern.match(text)
        if match:
            text = match.group(1).strip()
    return text


def _fix_fracs(text: str) -> str:
    text = _BRACELESS_FRAC.sub(r"\\frac{\1}{\2}", text)
    return _HALF_BRACED_FRAC.sub(lambda m: f"\\frac{{{m.group(1)}}}" if m.group(1) else
                                 f"\\frac{m.group(2)}{{{m.group(3)}}}", text)


def normalize_answer(answer: str) -> str:
    """Canonical string form of a math answer (see the module docstring for the steps)."""
    text = answer.strip().replace("\n", " ")
    for spacing in _SPACING:
        text = text.replace(spacing, " ")
    text = text.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for degree in ("^{\\circ}", "^\\circ", "°"):
        text = text.replace(degree, "")
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").strip()
    text = _strip_units(text)
    text = _TEXT_WRAP.sub(r"\1", text).strip()
    text = _LHS.sub("", text) if len(text) <= 16 else text  # "x = 5"; longer ones may be equations
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    text = re.sub(r"\s+", "", text)
    text = _BRACELESS_SQRT.sub(r"\\sqrt{\1}", _fix_fracs(text))
    text = _INT_SLASH.sub(r"\\frac{\1}{\2}", text)
    if text.startswith("."):
        text = "0" + text
    elif text.startswith("-."):
        text = "-0" + text[1:]
    match = _TRAILING_ZEROS.match(text)
    if match:
        text = match.group(1) + (f".{match.group(2)}" if match.group(2) else "")
    return text


def _as_rational(text: str) -> Fraction | None:
    """Exact value of a normalised plain number or `\\frac{p}{q}`; None for anything else."""
    match = _FRAC.match(text)
    try:
        if match:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return -value if match.group(1) else value
        if re.fullmatch(r"-?\d+(\.\d+)?", text):
            return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def is_equivalent(answer: str, ground_truth: str) -> bool:
    a, b = normalize_answer(answer), normalize_answer(ground_truth)
    if a == b:
        return True
    ra, rb = _as_rational(a), _as_rational(b)
    return ra is not None and ra == rb


def score_math(solution_str: str, ground_truth: str) -> float:
    boxed = last_boxed(solution_str)
    return 1.0 if boxed is not None and is_equivalent(boxed, str(ground_truth)) else 0.0


@register_reward(DATA_SOURCES[1])
@register_reward(DATA_SOURCES[0])
def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the last `\\boxed{}` of the response equals the ground truth after normalisation, else 0.0."""
    return score_math(solution_str, ground_truth)
