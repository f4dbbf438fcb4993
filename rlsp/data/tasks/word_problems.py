"""Synthetic gsm8k-format arithmetic word problems that a ~100M-parameter chat model can learn.

One-step problems built from templates ("Sam has 12 apples and buys 7 more. How many apples does Sam
have now?") with small operands: addition and subtraction with operands in [min_operand,
max_operand], multiplication with factors 2..`max_factor`. Rows follow verl's gsm8k layout and use
data_source "openai/gsm8k", so the gsm8k scorer (`#### <answer>`) grades them:
- `prompt`: one user message, the question followed by `INSTRUCTION`;
- `reward_model`: {"style": "rule", "ground_truth": "<integer>"};
- `extra_info`: {"split", "index", "question", "answer" (a worked solution ending in "#### N"),
  "template"}.

Deterministic: the same arguments give the same rows. The test split is held out by question
text: no test question appears in the training split.

CLI: `python -m rlsp.data.tasks.word_problems --out DIR [--n-train N --n-test M --seed S]`.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlsp.data.tasks import write_splits_parquet

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Give the final answer as a number after "####".'
NAMES = ("Sam", "Mia", "Leo", "Ava", "Ben", "Zoe", "Max", "Lily", "Tom", "Emma", "Noah", "Ella")
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "cards", "coins", "toy cars")


@dataclass(frozen=True)
class Template:
    """A problem text with {name}, {other}, {item}, {a}, {b} slots, its answer and its one-line working."""

    name: str
    text: str
    op: str  # "+", "-" or "*"
    answer: Callable[[int, int], int]


TEMPLATES = (
    Template("buys", "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", "+",
             lambda a, b: a + b),
    Template("picks", "{name} finds {a} {item} in the morning and {b} {item} in the afternoon. "
             "How many {item} does {name} find in total?", "+", lambda a, b: a + b),
    Template("gets", "{name} had {a} {item}. {other} gave {name} {b} more. How many {item} does {name} have now?",
             "+", lambda a, b: a + b),
    Template("gives", "{name} has {a} {item} and gives {b} of them to {other}. How many {item} does {name} have left?",
             "-", lambda a, b: a - b),
    Template("eats", "There are {a} {item} in a box. {name} takes {b} of them. How many {item} are left in the box?",
             "-", lambda a, b: a - b),
    Template("bags", "{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?", "*",
             lambda a, b: a * b),
)


def _operands(template: Template, rng: random.Random, lo: int, hi: int, max_factor: int) -> tuple[int, int]:
    if template.op == "*":
        return rng.randint(2, max_factor), rng.randint(2, max_factor)
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if template.op == "-" and a <= b:  # keep answers positive
        a, b = b + 1, a
    return a, b


def make_problem(template: Template, rng: random.Random, lo: int, hi: int, max_factor: int) -> dict[str, Any]:
    """One problem: question text, integer answer and a worked solution in gsm8k's answer format."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b = _operands(template, rng, lo, hi, max_factor)
    answer = template.answer(a, b)
    question = template.text.format(name=name, other=other, item=item, a=a, b=b)
    return {"question": question, "answer": answer, "solution": f"{a} {template.op} {b} = {answer}\n#### {answer}",
            "template": template.name}


def _row(problem: dict[str, Any], split: str, index: int, instruction: str) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem['question']} {instruction}".strip()}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem["answer"])},
        "extra_info": {"split": split, "index": index, "question": problem["question"],
                       "answer": problem["solution"], "template": problem["template"]},
    }


def _draw(n: int, rng: random.Random, exclude: set[str], lo: int, hi: int, max_factor: int) -> list[dict[str, Any]]:
    problems: list[dict[str, Any]] = []
    seen = set(exclude)
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"could not draw {n} distinct problems from operands [{lo}, {hi}]; widen the range")
        problem = make_problem(TEMPLATES[len(problems) % len(TEMPLATES)], rng, lo, hi, max_factor)
        if problem["question"] not in seen:  # template cycling keeps the mix of operations balanced
            seen.add(problem["question"])
            problems.append(problem)
    return problems


def generate_word_problems(
    n_train: int = 4096, n_test: int = 128, seed: int = 0, min_operand: int = 2, max_operand: int = 20,
    max_factor: int = 9, instruction: str = INSTRUCTION,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Return (train_rows, test_rows) in verl's layout; test questions never occur in train."""
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train={n_train}, n_test={n_test}: both must be >= 1")
    if not 0 <= min_operand < max_operand:
        raise ValueError(f"operand range [{min_operand}, {max_operand}] must satisfy 0 <= min < max")
    if max_factor < 2:
        raise ValueError(f"max_factor={max_factor} must be >= 2")
    rng = random.Random(seed)
    test = _draw(n_test, rng, set(), min_operand, max_operand, max_factor)
    train = _draw(n_train, rng, {p["question"] for p in test}, min_operand, max_operand, max_factor)
    # Distinct questions are drawn but training still sees templates in a fixed cycle: shuffle rows.
    rng.shuffle(train)
    return ([_row(p, "train", i, instruction) for i, p in enumerate(train)],
            [_row(p, "test", i, instruction) for i, p in enumerate(test)])


def write_word_problems_parquet(out_dir: str, **kwargs: Any) -> tuple[str, str]:
    """Write `train.parquet` and `test.parquet` under `out_dir`; kwargs go to `generate_word_problems`."""
    return write_splits_parquet(out_dir, *generate_word_problems(**kwargs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write gsm8k-format arithmetic word problems as verl-style parquet.")
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=4096)
    p.add_argument("--n-test", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-operand", type=int, default=2)
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--max-factor", type=int, default=9)
    args = p.parse_args(argv)
    train, test = write_word_problems_parquet(
        args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed, min_operand=args.min_operand,
        max_operand=args.max_operand, max_factor=args.max_factor,
    )
    print(train)
    print(test)


if __name__ == "__main__":
    main()
