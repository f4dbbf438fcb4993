"""GSM8K and MATH rule scorers against tables of tricky responses, and their registry entries."""

from __future__ import annotations

import pytest

from rlsp.data.answers import hash_answers, last_boxed
from rlsp.rewards import get_reward_fn, score_batch
from rlsp.rewards.gsm8k import extract_answer, normalize_number, score_gsm8k
from rlsp.rewards.math import is_equivalent, normalize_answer, score_math

# (response, ground truth, strict score, flexible score)
GSM8K_CASES = [
    ("12 + 7 = 19\n#### 19", "19", 1.0, 1.0),
    ("#### 19<|im_end|>", "19", 1.0, 1.0),
    ("####19", "19", 1.0, 1.0),  # no space after the marker
    ("The total is 1200 dollars.\n#### 1,200", "1200", 1.0, 1.0),  # thousands comma
    ("#### $1,200.00", "1200", 1.0, 1.0),  # currency, comma, trailing zeros
    ("So she has 19 apples.\n#### 19.", "19", 1.0, 1.0),  # sentence-final period
    ("#### 19.0", "19", 1.0, 1.0),
    ("#### -4", "-4", 1.0, 1.0),
    ("#### - 4", "-4", 1.0, 0.0),  # flexible reads the bare "4" after the spaced minus
    ("#### 0.375", ".375", 1.0, 1.0),
    ("#### 16.75", "16.75", 1.0, 1.0),
    ("#### 16.7", "16.75", 0.0, 0.0),
    ("#### 5\nWait, I made a mistake.\n#### 19", "19", 1.0, 1.0),  # the last marker counts
    ("#### 19\nSo the answer is 20.", "19", 1.0, 0.0),  # flexible takes the last number
    ("The answer is 19.", "19", 0.0, 1.0),  # no marker: strict gives nothing
    ("Sam has 12 apples and buys 7, so he has 19 apples.", "19", 0.0, 1.0),
    ("19 is the answer, not 20", "19", 0.0, 0.0),
    ("####", "19", 0.0, 0.0),
    ("#### nineteen", "19", 0.0, 0.0),
    ("", "19", 0.0, 0.0),
    ("#### 12 + 7 = 19", "19", 0.0, 1.0),  # strict reads the number right after the marker
    ("#### 019", "19", 1.0, 1.0),
    ("#### 190", "19", 0.0, 0.0),
    ("#### 1.9", "19", 0.0, 0.0),
]


@pytest.mark.parametrize(("response", "truth", "strict", "flexible"), GSM8K_CASES)
def test_gsm8k_scorer(response: str, truth: str, strict: float, flexible: float) -> None:
    assert score_gsm8k(response, truth, method="strict") == strict
    assert score_gsm8k(response, truth, method="flexible") == flexible


def test_gsm8k_format_score_and_methods() -> None:
    assert score_gsm8k("#### 18", "19", format_score=0.1) == 0.1  # well-formed but wrong
    assert score_gsm8k("no number here", "19", format_score=0.1) == 0.0
    assert extract_answer("a 3 b 4.50 c") is None and extract_answer("a 3 b 4.50 c", "flexible") == "4.5"
    with pytest.raises(ValueError, match="legal: \\['strict', 'flexible'\\]"):
        extract_answer("#### 1", method="loose")


@pytest.mark.parametrize(("raw", "canonical"), [
    ("1,234", "1234"), ("$5", "5"), ("-$3", "-3"), ("7.", "7"), ("2.50", "2.5"), ("0.0", "0"), ("-0", "0"),
    (".5", "0.5"), ("abc", None), ("", None), ("Infinity", None), ("NaN", None),
])
def test_normalize_number(raw: str, canonical: str | None) -> None:
    assert normalize_number(raw) == canonical


# (response, ground truth, expected score)
MATH_CASES = [
    ("so the answer is $\\boxed{\\frac{11}{12}}$.", "\\frac{11}{12}", 1.0),
    ("$\\boxed{\\dfrac{1}{3}}$", "\\frac{1}{3}", 1.0),  # \dfrac
    ("$\\boxed{\\tfrac13}$", "\\frac{1}{3}", 1.0),  # \tfrac and braceless
    ("\\boxed{1/3}", "\\frac{1}{3}", 1.0),  # integer slash fraction
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # decimal vs fraction, compared as rationals
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})", 1.0),  # \left/\right and spacing
    ("\\boxed{720^\\circ}", "720", 1.0),  # degrees
    ("\\boxed{54 \\text{ square units}}", "54", 1.0),  # units in \text
    ("\\boxed{10 \\mbox{ cm}}", "10", 1.0),
    ("\\boxed{12 inches}", "12", 1.0),  # plain-word unit
    ("\\boxed{\\$16.75}", "16.75", 1.0),  # dollar sign
    ("\\boxed{50\\%}", "50", 1.0),  # percent
    ("\\boxed{6.0}", "6", 1.0),  # trailing .0
    ("\\boxed{6.50}", "6.5", 1.0),
    ("\\boxed{x = 6}", "6", 1.0),  # leading variable assignment
    ("\\boxed{1,000}", "1000", 1.0),  # thousands comma
    ("\\boxed{2, 3}", "2,3", 1.0),  # a list keeps its comma
    ("\\boxed{.5}", "\\frac12", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "\\frac{-3}{4}", 1.0),
    ("\\boxed{\\frac{\\sqrt3}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # braceless \sqrt
    ("\\boxed{x+3}", "x + 3", 1.0),  # spacing
    ("\\boxed{x+3}", "x+2", 0.0),
    ("\\boxed{9\\pi}", "9\\pi", 1.0),
    ("first \\boxed{5} then \\boxed{6}", "6", 1.0),  # the last box counts
    ("first \\boxed{6} then \\boxed{5}", "6", 0.0),
    ("\\boxed 6", "6", 1.0),  # braceless \boxed
    ("\\fbox{6}", "6", 1.0),
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # never closed
    ("The answer is 6.", "6", 0.0),  # no box
    ("\\boxed{\\text{(C)}}", "(C)", 1.0),
    ("\\boxed{10}", "100", 0.0),
    ("\\boxed{\\frac{2}{0}}", "\\frac{1}{0}", 0.0),  # division by zero is no number
]


@pytest.mark.parametrize(("response", "truth", "expected"), MATH_CASES)
def test_math_scorer(response: str, truth: str, expected: float) -> None:
    assert score_math(response, truth) == expected


def test_boxed_and_hash_extraction() -> None:
    assert last_boxed("x \\boxed{\\frac{a}{\\sqrt{b}}} y") == "\\frac{a}{\\sqrt{b}}"  # nested braces
    assert last_boxed("no box") is None
    assert last_boxed("$\\boxed 42$.") == "42"
    assert hash_answers("a\n#### 3\nb\n#### $1,200") == ["3", "$1,200"]
    assert normalize_answer("\\left(1,2\\right)") == "(1,2)"
    assert is_equivalent("\\frac{4}{8}", "0.5") and not is_equivalent("x", "y")


def test_registry_dispatches_by_data_source() -> None:
    assert get_reward_fn("openai/gsm8k")("openai/gsm8k", "#### 4", "4") == 1.0
    for source in ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH"):
        assert get_reward_fn(source)(source, "\\boxed{4}", "4") == 1.0
    scores = score_batch(
        ["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval", "openai/gsm8k"],
        ["#### 4", "\\boxed{\\dfrac{1}{2}}", "4"],
        ["4", "\\frac{1}{2}", "4"],
    )
    assert scores == [1.0, 1.0, 0.0]
