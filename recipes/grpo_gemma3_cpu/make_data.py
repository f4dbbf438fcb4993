"""Completion-style arithmetic prompts for the pretrained (not instruction-tuned) Gemma 3 270M.

The base model has no chat template (its GGUF carries none) and continues plain text, so the prompts are
strings written as the model reads them: `<bos>` (the dataset tokenizes prompts without special tokens;
Gemma needs it) then "a+b=". Rows come from rlsp's arithmetic task (`rlsp.data.tasks.arithmetic`,
data_source "rlsp/arithmetic", scored by `rlsp.rewards.arithmetic`): operands 0..9, additions, the
answer drawn uniformly for training rows; a fifth of the 100 pairs (20) held out as the test split.

Usage: `python recipes/grpo_gemma3_cpu/make_data.py --out DIR` writes DIR/train.parquet and DIR/test.parquet.
"""

from __future__ import annotations

import argparse
from typing import Any

from rlsp.data.tasks import write_splits_parquet
from rlsp.data.tasks.arithmetic import generate_arithmetic

BOS = "<bos>"
# One worked example before each question, with operands outside the task's 0..9 so no question's answer is shown;
# it shows the model the format (the number, then a new line).
EXAMPLE = "12+5=17\n"


def as_completion(row: dict[str, Any], example: str = EXAMPLE) -> dict[str, Any]:
    """The row with its one user message turned into a plain-text prompt after `example`."""
    (message,) = row["prompt"]
    return {**row, "prompt": BOS + example + message["content"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--n-train", type=int, default=2048)
    p.add_argument("--example", default=EXAMPLE, help="text before each question ('' for none)")
    args = p.parse_args(argv)
    train, test = generate_arithmetic(n_train=args.n_train, n_test=20, max_operand=args.max_operand, ops=("+",))
    print(*write_splits_parquet(args.out, [as_completion(r, args.example) for r in train],
                                     [as_completion(r, args.example) for r in test]))


if __name__ == "__main__":
    main()
