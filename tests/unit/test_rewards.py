"""Arithmetic reward shaping, the data_source registry and custom reward loading."""

from __future__ import annotations

import pytest

from rlsp.rewards import get_reward_fn, known_sources, load_custom_reward_fn, register_reward, score_batch
from rlsp.rewards.arithmetic import clean_response, compute_score

SRC = "rlsp/arithmetic"


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("7", "7", 1.0),
        (" 7 \n", "7", 1.0),
        ("7<|im_end|>", "7", 1.0),
        ("7 <|im_end|><|endoftext|><|pad|>", "7", 1.0),
        ("12", "12", 1.0),
        ("-3", "-3", 1.0),
        ("07", "7", 1.0),  # same integer
        ("7 apples", "7", 0.5),  # right answer, did not stop
        ("777", "7", 0.5),
        ("7<|im_end|>x", "7", 0.5),  # only *trailing* end tokens are stripped
        ("8", "7", 0.1),  # well-formed, wrong
        ("8<|im_end|>", "7", 0.1),
        ("1", "12", 0.1),
        ("8 apples", "7", 0.0),  # wrong and not stopped
        ("87", "7", 0.1),
        ("", "7", 0.0),
        ("<|im_end|>", "7", 0.0),
        ("=7", "7", 0.0),
        ("seven", "7", 0.0),
    ],
)
def test_arithmetic_shaping(response: str, truth: str, expected: float) -> None:
    assert compute_score(SRC, response, truth) == expected


def test_clean_response_strips_only_trailing_end_tokens() -> None:
    assert clean_response("  7<|im_end|> <|endoftext|>\n") == "7"
    assert clean_response("<|im_end|>7") == "<|im_end|>7"


def test_registry_lookup_and_errors() -> None:
    assert SRC in known_sources()
    assert get_reward_fn(SRC) is compute_score
    with pytest.raises(ValueError, match=r"no reward function for data_source 'nope'.*rlsp/arithmetic"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="already has a reward function"):
        register_reward(SRC)(lambda *a, **k: 0.0)


def test_register_and_score_batch_dispatches_by_source() -> None:
    @register_reward("test/length")
    def length_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return len(solution_str) / (10 if extra_info is None else extra_info["scale"])

    scores = score_batch([SRC, "test/length", SRC, "test/length"], ["3", "abcd", "x", "ab"], ["3", "", "1", ""],
                         [None, {"scale": 4}, None, {"scale": 8}])
    assert scores == [1.0, 1.0, 0.0, 0.25]
    assert score_batch(["test/length"], ["abcde"], [""]) == [0.5]
    with pytest.raises(ValueError, match="equal lengths"):
        score_batch([SRC], ["1", "2"], ["1"])


def test_load_custom_reward_fn(tmp_path) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text(
        "THRESHOLD = 3\n"
        "def helper(x):\n    return x\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) >= THRESHOLD)\n"
    )
    fn = load_custom_reward_fn(str(path), "compute_score")
    assert fn("any", "abc", "") == 1.0 and fn("any", "ab", "") == 0.0


def test_load_custom_reward_fn_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="custom reward file not found"):
        load_custom_reward_fn(str(tmp_path / "missing.py"), "compute_score")
    path = tmp_path / "r.py"
    path.write_text("SCORE = 1.0\ndef other(a, b, c, d=None):\n    return 0.0\n")
    with pytest.raises(ValueError, match=r"no attribute 'compute_score'.*callables found: \['other'\]"):
        load_custom_reward_fn(str(path), "compute_score")
    with pytest.raises(ValueError, match="'SCORE' .* is a float, not a callable"):
        load_custom_reward_fn(str(path), "SCORE")
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('boom')\n")
    with pytest.raises(RuntimeError, match="boom"):
        load_custom_reward_fn(str(broken), "compute_score")
    text = tmp_path / "r.txt"
    text.write_text("x")
    with pytest.raises(ValueError, match=r"must be a \.py file"):
        load_custom_reward_fn(str(text), "compute_score")
