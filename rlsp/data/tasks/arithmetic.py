"""Synthetic arithmetic task: "a+b=" prompts with single-digit integer answers.

Small enough for a tiny random-init model to learn with GRPO on a CPU in minutes: the prompt is the
user message `"2+1="` (rendered through the chat template), the expected response is `"3"` followed
by the end-of-turn token. Rows follow verl's parquet layout: `data_source`, `prompt` (chat
messages), `ability`, `reward_model` ({"style": "rule", "ground_truth"}), `extra_info` ({"split",
"index", "a", "b", "op"}).

Default operands 0..2 (answers 0..4). Measured with a plain GRPO loop on the tiny model (16 prompts
x 8 samples, <= 8 new tokens, lr 1e-3, no KL or entropy term; mean reward starts at ~0.03):
- operands 0..2: 3 of 5 seeds reached 0.5-0.7 by step 200; 2 settled at ~0.35, mostly one answer
  for every prompt (which alone scores 0.1 + 0.9/5 = 0.28); rerun with an entropy bonus of 0.02,
  one of those two reached 0.91 (94% exact), the other stayed at ~0.35;
- operands 0..4 (`max_operand=4`): 3 of 6 seeds reached ~0.5 by step 200, 3 collapsed onto one
  answer at ~0.22; with an entropy bonus of 0.02, 4 of 4 seeds learned (0.28-0.48 at step 200).

Balanced answers (default): training rows draw the *answer* uniformly, then a pair with that answer,
so no answer dominates. With the natural pair distribution (the middle answer has the most pairs)
GRPO tends to collapse onto the most frequent answer before it learns to read the operands.

Splits: operand pairs are shuffled with the seed; when the pair space has at least
`MIN_PAIRS_FOR_HOLDOUT` pairs, a fifth of them is held out for the test split. The default space
(9 pairs) is too small to hold out from, so the test split then lists every pair once and validation
measures greedy accuracy on the table the policy is trained on.

CLI: `python -m rlsp.data.tasks.arithmetic --out DIR [--n-train N --n-test M --max-operand K]`.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable
from typing import Any

DATA_SOURCE = "rlsp/arithmetic"
MIN_PAIRS_FOR_HOLDOUT = 50
OPS: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _split_pairs(pairs: list[tuple[int, int, str]], rng: random.Random) -> tuple[list, list]:
    pairs = list(pairs)
    rng.shuffle(pairs)
    if len(pairs) < MIN_PAIRS_FOR_HOLDOUT:
        return pairs, pairs
    n_test = max(1, len(pairs) // 5)
    return pairs[n_test:], pairs[:n_test]


def _make_row(a: int, b: int, op: str, split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(OPS[op](a, b))},
        "extra_info": {"split": split, "index": index, "a": a, "b": b, "op": op},
    }


def _balanced_rows(pairs: list, n: int, split: str, rng: random.Random) -> list[dict[str, Any]]:
    """`n` rows whose answers cycle uniformly over the answers present in `pairs`."""
    by_answer: dict[int, list] = {}
    for a, b, op in pairs:
        by_answer.setdefault(OPS[op](a, b), []).append((a, b, op))
    answers = sorted(by_answer)
    rows: list[dict[str, Any]] = []
    order: list[int] = []
    while len(rows) < n:
        if not order:
            order = list(answers)
            rng.shuffle(order)
        a, b, op = rng.choice(by_answer[order.pop()])
        rows.append(_make_row(a, b, op, split, len(rows)))
    return rows


def _cycle_rows(pairs: list, n: int, split: str, rng: random.Random) -> list[dict[str, Any]]:
    """`n` rows cycling through `pairs`, reshuffled every pass so each pair appears equally often."""
    rows: list[dict[str, Any]] = []
    order: list = []
    while len(rows) < n:
        if not order:
            order = list(pairs)
            rng.shuffle(order)
        a, b, op = order.pop()
        rows.append(_make_row(a, b, op, split, len(rows)))
    return rows


def generate_arithmetic(
    n_train: int = 2048,
    n_test: int = 9,
    seed: int = 0,
    min_operand: int = 0,
    max_operand: int = 2,
    ops: tuple[str, ...] = ("+",),
    balance_answers: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Return (train_rows, test_rows); see the module docstring for the split rule."""
    bad = [op for op in ops if op not in OPS]
    if bad or not ops:
        raise ValueError(f"ops={ops}: each must be one of {sorted(OPS)}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"operand range [{min_operand}, {max_operand}] must satisfy 0 <= min <= max")
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train={n_train}, n_test={n_test}: both must be >= 1")
    rng = random.Random(seed)
    values = range(min_operand, max_operand + 1)
    pairs = [(a, b, op) for op in ops for a in values for b in values]
    train_pairs, test_pairs = _split_pairs(pairs, rng)
    make_train = _balanced_rows if balance_answers else _cycle_rows
    return make_train(train_pairs, n_train, "train", rng), _cycle_rows(test_pairs, n_test, "test", rng)


def write_arithmetic_parquet(out_dir: str, **kwargs: Any) -> tuple[str, str]:
    """Write `train.parquet` and `test.parquet` under `out_dir`; kwargs go to `generate_arithmetic`."""
    import pandas as pd  # noqa: PLC0415 -- keeps the generator importable without pandas

    train_rows, test_rows = generate_arithmetic(**kwargs)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, rows in (("train", train_rows), ("test", test_rows)):
        path = os.path.join(os.path.abspath(out_dir), f"{name}.parquet")
        # Write then rename so a concurrent reader never sees a partial file.
        tmp = f"{path}.tmp-{os.getpid()}"
        pd.DataFrame(rows).to_parquet(tmp, index=False)
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write the synthetic arithmetic task as verl-style parquet.")
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=2048)
    p.add_argument("--n-test", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-operand", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=2)
    p.add_argument("--ops", default="+", help="operators to use, e.g. '+' or '+-'")
    p.add_argument("--natural-answers", action="store_true", help="sample pairs uniformly, not answers")
    args = p.parse_args(argv)
    train, test = write_arithmetic_parquet(
        args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed,
        min_operand=args.min_operand, max_operand=args.max_operand, ops=tuple(args.ops),
        balance_answers=not args.natural_answers,
    )
    print(train)
    print(test)


if __name__ == "__main__":
    main()
