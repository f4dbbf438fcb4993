"""The calculator-tool task: its generator (determinism, held-out split, exact ground truths, prompt shape), its
reward (only the final assistant message counts; the text fallback without messages) and their registration."""

from __future__ import annotations

import ast
import operator

import pyarrow.parquet as pq
import pytest

from rlsp.agent.parsing import parse_tool_calls
from rlsp.agent.tools.calculator import evaluate
from rlsp.data.tasks.calculator_problems import (
    DATA_SOURCE,
    EXAMPLE_QUESTION,
    FEW_SHOT,
    TEMPLATES,
    generate_calculator_problems,
    write_calculator_problems_parquet,
)
from rlsp.rewards import calculator
from rlsp.rewards.calculator import compute_score, last_integer
from rlsp.rewards.registry import get_reward_fn, known_sources
from rlsp.run.assets import BUILTIN_DATASETS, resolve_data_files

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _exact(expression: str) -> int:
    """`a op b` evaluated exactly with integers (independent of the calculator tool)."""
    node = ast.parse(expression, mode="eval").body
    assert isinstance(node, ast.BinOp) and type(node.op) in _OPS, expression
    return _OPS[type(node.op)](node.left.value, node.right.value)


def _conversation(row: dict, *turns: dict) -> dict:
    return {**row["extra_info"], "messages": [*row["prompt"], *turns]}


def test_generator_is_deterministic_and_seeded() -> None:
    assert generate_calculator_problems(n_train=300, n_test=50, seed=1) == \
        generate_calculator_problems(n_train=300, n_test=50, seed=1)
    assert generate_calculator_problems(n_train=300, n_test=50, seed=2)[0] != \
        generate_calculator_problems(n_train=300, n_test=50, seed=1)[0]


def test_test_split_is_held_out_by_question() -> None:
    train, test = generate_calculator_problems(n_train=2000, n_test=128, seed=0)
    train_q = {r["extra_info"]["question"] for r in train}
    test_q = {r["extra_info"]["question"] for r in test}
    assert len(train_q) == 2000 and len(test_q) == 128
    assert not train_q & test_q
    assert EXAMPLE_QUESTION not in train_q | test_q  # the worked example is never asked
    assert [r["extra_info"]["index"] for r in test] == list(range(128))
    assert {r["extra_info"]["split"] for r in train} == {"train"}


def test_ground_truths_are_the_expressions_exact_values() -> None:
    train, test = generate_calculator_problems(n_train=1000, n_test=128, seed=0)
    for row in train + test:
        info, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        assert truth == str(_exact(info["expression"])) == evaluate(info["expression"])
        a, _, b = info["expression"].split()
        assert a in info["question"] and b in info["question"]
        assert info["tools_kwargs"] == {"calculator": {"create_kwargs": {"ground_truth": truth}}}
    assert {r["extra_info"]["template"] for r in test} == {t.name for t in TEMPLATES}


def test_operands_are_large() -> None:
    for row in generate_calculator_problems(n_train=500, n_test=10, seed=0)[0]:
        a, op, b = row["extra_info"]["expression"].split()
        if op == "*":
            assert 101 <= int(a) <= 9999 and 12 <= int(b) <= 999
        else:
            assert 1000 <= int(b) <= 99999 and (op == "+" or int(a) > int(b))


def test_prompt_is_system_few_shot_question() -> None:
    row = generate_calculator_problems(n_train=1, n_test=1)[1][0]
    prompt = row["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert "<tool_call>" in prompt[0]["content"] and "The answer is N." in prompt[0]["content"]
    assert tuple(prompt[1:5]) == FEW_SHOT and prompt[-1]["content"] == row["extra_info"]["question"]
    # The worked call is one the agent loop's parser accepts, with the tool's one parameter.
    _, calls = parse_tool_calls(FEW_SHOT[1]["content"], "hermes")
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "312 * 45"}, None)]
    assert FEW_SHOT[2]["content"] == evaluate("312 * 45")
    assert row["data_source"] == DATA_SOURCE and row["reward_model"]["style"] == "rule"


def test_parquet_round_trip_and_builtin_name(tmp_path) -> None:
    train_path, test_path = write_calculator_problems_parquet(str(tmp_path), n_train=32, n_test=8, seed=0)
    assert pq.read_table(test_path).to_pylist() == generate_calculator_problems(n_train=32, n_test=8)[1]
    assert "calculator_problems" in BUILTIN_DATASETS
    files = resolve_data_files(["builtin://calculator_problems/train", "builtin://calculator_problems/test"],
                               str(tmp_path))
    assert files == [str(tmp_path / "data" / "calculator_problems" / f"{s}.parquet") for s in ("train", "test")]


def test_reward_scores_only_the_final_assistant_message() -> None:
    row = generate_calculator_problems(n_train=1, n_test=1)[1][0]
    truth = row["reward_model"]["ground_truth"]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": row["extra_info"]["expression"]}}}]}
    tool = {"role": "tool", "name": "calculator", "content": truth}
    trajectory = f"<tool_call>...</tool_call><|im_end|>\n<|im_start|>tool\n{truth}<|im_end|>\n"
    right = _conversation(row, call, tool, {"role": "assistant", "content": f"The answer is {truth}."})
    assert compute_score(DATA_SOURCE, trajectory + f"The answer is {truth}.", truth, right) == 1.0
    # The right number only in the tool's output: the final message answers something else, or nothing.
    wrong = _conversation(row, call, tool, {"role": "assistant", "content": "The answer is 12."})
    assert compute_score(DATA_SOURCE, trajectory + "The answer is 12.", truth, wrong) == 0.0
    # As the agent loop reports it (with the evaluated call): the call's small credit, never an accurate 1.0.
    logged = {**wrong, "tool_calls": [{"name": "calculator", "arguments": {"expression": "1"}, "response": truth,
                                       "error": None, "reward": 0.0}]}
    assert compute_score(DATA_SOURCE, trajectory + "The answer is 12.", truth, logged) == calculator.FORMAT_SCORE < 1.0
    no_answer = _conversation(row, call, tool, {"role": "assistant", "content": "Let me check."})
    assert compute_score(DATA_SOURCE, trajectory, truth, no_answer) == 0.0
    # A last turn that is itself a call (turn limit reached): no answer, whatever its expression holds.
    assert compute_score(DATA_SOURCE, trajectory, truth, _conversation(row, call, tool, call)) == 0.0
    # The few-shot answer in the prompt never counts as the rollout's answer.
    assert compute_score(DATA_SOURCE, "", "14040", _conversation(row, call, tool, call)) == 0.0


def test_reward_reads_the_last_integer_with_thousands_separators() -> None:
    row = generate_calculator_problems(n_train=1, n_test=1)[1][0]
    say = lambda text: _conversation(row, {"role": "assistant", "content": text})  # noqa: E731
    assert compute_score(DATA_SOURCE, "", "1913937", say("4821 * 397 = 1,913,937. The answer is 1,913,937.")) == 1.0
    assert compute_score(DATA_SOURCE, "", "1913937", say("The answer is 1913937, not 5.")) == 0.0
    assert compute_score(DATA_SOURCE, "", "-42", say("The answer is -42.")) == 1.0
    assert last_integer("no digits") is None and last_integer("1,2") == 2


def test_reward_falls_back_to_the_text_without_messages() -> None:
    assert compute_score(DATA_SOURCE, "The answer is 370523.<|im_end|>", "370523", None) == 1.0
    assert compute_score(DATA_SOURCE, "The answer is 370523.", "370523", {"index": 3}) == 1.0
    assert compute_score(DATA_SOURCE, "The answer is 12.", "370523", {}) == 0.0
    # A bare tool call is not an answer, even when its expression ends in the right number.
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "370523"}}\n</tool_call>'
    assert compute_score(DATA_SOURCE, call, "370523", None) == 0.0


def test_format_credit_only_for_an_evaluated_call(monkeypatch) -> None:
    row = generate_calculator_problems(n_train=1, n_test=1)[1][0]
    truth = row["reward_model"]["ground_truth"]
    final = {"role": "assistant", "content": "The answer is 12."}
    good = {**_conversation(row, final), "tool_calls": [{"name": "calculator", "response": "5", "error": None}]}
    bad = {**_conversation(row, final), "tool_calls": [{"name": "calculator", "response": "Error: x",
                                                        "error": "bad_arguments"}]}
    assert compute_score(DATA_SOURCE, "", truth, good) == calculator.FORMAT_SCORE == 0.1
    assert compute_score(DATA_SOURCE, "", truth, bad) == 0.0
    refused = {**good, "tool_calls": [{"name": "calculator", "arguments": {"exponent": 3}, "error": None,
                                       "response": "Error: the 'expression' parameter must be a string, got None"}]}
    assert compute_score(DATA_SOURCE, "", truth, refused) == 0.0  # the calculator's own refusal earns nothing
    right = {**good, "messages": [*good["messages"][:-1], {"role": "assistant", "content": f"The answer is {truth}."}]}
    assert compute_score(DATA_SOURCE, "", truth, right) == 1.0
    monkeypatch.setattr(calculator, "FORMAT_SCORE", 0.0)  # off: calls without the right answer score 0
    assert compute_score(DATA_SOURCE, "", truth, good) == 0.0


def test_registered_and_refuses_a_non_integer_truth() -> None:
    assert DATA_SOURCE in known_sources()
    assert get_reward_fn(DATA_SOURCE) is compute_score
    with pytest.raises(ValueError, match="not an integer"):
        compute_score(DATA_SOURCE, "The answer is 3.", "three", None)
