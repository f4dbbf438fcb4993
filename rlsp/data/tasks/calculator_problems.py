"""Arithmetic problems with operands too large to work out in the head, for learning to call a calculator tool.

Products of a 3-4 digit and a 2-3 digit number, sums and differences of two 4-5 digit numbers, asked
either plainly ("What is 4821 * 397?") or as a one-step word problem ("A farmer plants 1234 rows with
567 trees in each row. How many trees does the farmer plant?"). Rows follow verl's layout with
data_source "rlsp/calculator_problems" (scored by rlsp/rewards/calculator.py):
- `prompt`: chat messages: a system message describing the calculator, the exact hermes call format
  and the answer format ("The answer is N."); one worked exchange (user question, assistant tool call,
  tool result, assistant answer); then the problem as the user message. The calculator is described in
  the prompt because not every chat template renders tool schemas (SmolLM2's does not);
- `reward_model`: {"style": "rule", "ground_truth": "<integer>"};
- `extra_info`: {"split", "index", "question", "expression" (what to evaluate, e.g. "4821 * 397"),
  "template", "tools_kwargs"} with verl's per-tool kwargs: {"calculator": {"create_kwargs":
  {"ground_truth": "<integer>"}}}, for tools that check answers (the built-in calculator ignores it).

Deterministic: the same arguments give the same rows. The test split is held out by question text:
no test question appears in the training split.

CLI: `python -m rlsp.data.tasks.calculator_problems --out DIR [--n-train N --n-test M --seed S]`.
"""

from __future__ import annotations

import argparse
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlsp.data.tasks import write_splits_parquet

DATA_SOURCE = "rlsp/calculator_problems"
TOOL_NAME = "calculator"
SYSTEM_PROMPT = (
    "You can use a calculator tool. To call it, reply with exactly:\n"
    "<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "<arithmetic expression>"}}\n'
    "</tool_call>\n"
    "The result comes back in a tool message. Then give the final answer as 'The answer is N.'"
)
EXAMPLE_QUESTION = "What is 312 * 45?"
EXAMPLE_EXPRESSION = "312 * 45"
FEW_SHOT: tuple[dict[str, str], ...] = (
    {"role": "user", "content": EXAMPLE_QUESTION},
    {"role": "assistant", "content": (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + EXAMPLE_EXPRESSION + '"}}\n</tool_call>')},
    {"role": "tool", "content": "14040"},
    {"role": "assistant", "content": "The answer is 14040."},
)
OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class Template:
    """A question with {a} and {b} slots and the operation that answers it (the expression is `a op b`)."""

    name: str
    text: str
    op: str  # "+", "-" or "*"


TEMPLATES = (
    Template("plain_mul", "What is {a} * {b}?", "*"),
    Template("rows", "A farmer plants {a} rows with {b} trees in each row. How many trees does the farmer plant?", "*"),
    Template("crates", "A factory fills {a} crates with {b} bottles each. How many bottles are in the crates?", "*"),
    Template("plain_add", "What is {a} + {b}?", "+"),
    Template("library", "A library has {a} books and buys {b} more. How many books does the library have now?", "+"),
    Template("visitors", "A museum had {a} visitors in May and {b} visitors in June. How many visitors came in "
             "the two months?", "+"),
    Template("plain_sub", "What is {a} - {b}?", "-"),
    Template("warehouse", "A warehouse holds {a} boxes and ships {b} of them. How many boxes are left?", "-"),
    Template("savings", "A school raised {a} dollars and spent {b} dollars. How many dollars are left?", "-"),
)


def _operands(op: str, rng: random.Random) -> tuple[int, int]:
    """A 3-4 digit times a 2-3 digit number; two 4-5 digit numbers for + and - (a > b for -)."""
    if op == "*":
        return rng.randint(101, 9999), rng.randint(12, 999)
    a, b = rng.randint(1000, 99999), rng.randint(1000, 99999)
    if op == "-" and a <= b:  # keep answers positive
        a, b = b + 1, a
    return a, b


def make_problem(template: Template, rng: random.Random) -> dict[str, Any]:
    """One problem: question text, the expression that answers it and its exact integer value."""
    if template.op not in OPERATIONS:
        raise ValueError(f"template {template.name!r} has op {template.op!r}; legal: {sorted(OPERATIONS)}")
    a, b = _operands(template.op, rng)
    return {"question": template.text.format(a=a, b=b), "expression": f"{a} {template.op} {b}",
            "answer": OPERATIONS[template.op](a, b), "template": template.name}


def prompt_messages(question: str) -> list[dict[str, str]]:
    """The chat messages of one problem: system description, the worked exchange, the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, *(dict(m) for m in FEW_SHOT),
            {"role": "user", "content": question}]


def _row(problem: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    truth = str(problem["answer"])
    return {
        "data_source": DATA_SOURCE,
        "prompt": prompt_messages(problem["question"]),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "question": problem["question"],
                       "expression": problem["expression"], "template": problem["template"],
                       "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": truth}}}},
    }


def _draw(n: int, rng: random.Random, exclude: set[str]) -> list[dict[str, Any]]:
    problems: list[dict[str, Any]] = []
    seen = set(exclude) | {EXAMPLE_QUESTION}  # the worked example is never a problem
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"could not draw {n} distinct problems; ask for fewer")
        problem = make_problem(TEMPLATES[len(problems) % len(TEMPLATES)], rng)
        if problem["question"] not in seen:  # template cycling keeps the mix of operations balanced
            seen.add(problem["question"])
            problems.append(problem)
    return problems


def generate_calculator_problems(
    n_train: int = 4096, n_test: int = 128, seed: int = 0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Return (train_rows, test_rows) in verl's layout; test questions never occur in train."""
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train={n_train}, n_test={n_test}: both must be >= 1")
    rng = random.Random(seed)
    test = _draw(n_test, rng, set())
    train = _draw(n_train, rng, {p["question"] for p in test})
    # Distinct questions are drawn but training would see templates in a fixed cycle: shuffle rows.
    rng.shuffle(train)
    return ([_row(p, "train", i) for i, p in enumerate(train)],
            [_row(p, "test", i) for i, p in enumerate(test)])


def write_calculator_problems_parquet(out_dir: str, **kwargs: Any) -> tuple[str, str]:
    """Write `train.parquet` and `test.parquet` under `out_dir`; kwargs go to `generate_calculator_problems`."""
    return write_splits_parquet(out_dir, *generate_calculator_problems(**kwargs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write calculator-tool arithmetic problems as verl-style parquet.")
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=4096)
    p.add_argument("--n-test", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    train, test = write_calculator_problems_parquet(args.out, n_train=args.n_train, n_test=args.n_test,
                                                    seed=args.seed)
    print(train)
    print(test)


if __name__ == "__main__":
    main()
