"""Turn GSM8K / MATH exports of the Hugging Face Hub into verl-layout parquet for training.

Input: a `.jsonl`/`.json` (one record per line) or `.parquet` file as the Hub exports it —
gsm8k records have `question` and `answer` (worked solution ending in "#### N"); MATH records have
`problem`, `solution` (with a final `\\boxed{}`), `level` and `type`. Output: `<output>/<split>.parquet`
with exactly verl's columns:
- `data_source`: "openai/gsm8k" or "DigitalLearningGmbH/MATH-lighteval" (selects the scorer);
- `prompt`: [{"role": "user", "content": question + " " + instruction}];
- `ability`: "math";
- `reward_model`: {"style": "rule", "ground_truth": final answer ("1200"; the boxed LaTeX for MATH)};
- `extra_info`: {"split", "index", ...}: gsm8k adds the raw "question" and "answer", MATH "level"
  and "type".

`gsm8k_multiturn` writes the rows of verl's GSM8K multi-turn tool example (its
gsm8k_multiturn_w_tool preprocessing) from the same gsm8k records: columns `data_source`, `agent_name`
("tool_agent"), `prompt` (a system message asking the model to check its answer with the
`calc_gsm8k_reward` tool, then the user message), `ability`, `reward_model`, `extra_info`; extra_info
adds "need_tools_kwargs", "tools_kwargs" ({"calc_gsm8k_reward": {"create_kwargs": {"ground_truth"}}}: the
tool's instance is created with the answer) and verl's "interaction_kwargs" (which rlsp does not use).

`geo3k` writes verl's Geometry3K rows (with an `images` column) from the Hub's hiyouga/geometry3k records
(`problem`, `answer`, `images`); see rlsp.data.vision_geo3k.

CLI: `python -m rlsp.data.preprocess {gsm8k,gsm8k_multiturn,math,geo3k} --input FILE --output DIR [--split train]`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Callable
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from rlsp.data.answers import hash_answers, last_boxed
from rlsp.data.vision_geo3k import geo3k_row

GSM8K_SOURCE = "openai/gsm8k"
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
GSM8K_TOOL_AGENT = "tool_agent"
GSM8K_TOOL_NAME = "calc_gsm8k_reward"  # the checker tool's name (rlsp.agent.tools.gsm8k uses it too)
GSM8K_TOOL_SYSTEM_PROMPT = (
    "You are an expert at math word problems. Work through the question one step at a time, and do the "
    "reasoning before you call any tool. Once you have solved it, call the `calc_gsm8k_reward` tool at least "
    "once with your answer before you write the final answer, and revise the answer if the tool says so. "
    "Write the final answer as `#### <answer>`."
)


def read_records(path: str) -> list[dict[str, Any]]:
    """Records of a .jsonl/.json (one JSON object per line) or .parquet file."""
    if not os.path.isfile(path):
        raise ValueError(f"input file not found: {path}")
    if path.endswith(".parquet"):
        return pd.read_parquet(path).to_dict(orient="records")
    if path.endswith((".jsonl", ".json")):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    raise ValueError(f"input {path}: unsupported extension; legal: .jsonl, .json (JSON lines), .parquet")


def _require(record: dict[str, Any], keys: tuple[str, ...], index: int, task: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"{task} record {index} lacks {missing}; it has {sorted(record)} (expected {list(keys)})")


def gsm8k_row(record: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    _require(record, ("question", "answer"), index, "gsm8k")
    found = hash_answers(record["answer"])
    if not found:
        raise ValueError(f"gsm8k record {index}: answer has no '#### <number>' line: {record['answer'][-80:]!r}")
    truth = found[-1].replace(",", "").replace("$", "").replace(" ", "")
    return {
        "data_source": GSM8K_SOURCE,
        "prompt": [{"role": "user", "content": f"{record['question']} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "answer": record["answer"], "question": record["question"]},
    }


def gsm8k_multiturn_row(record: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """A gsm8k record as a row of verl's multi-turn tool example (see the module docstring)."""
    row = gsm8k_row(record, split, index)
    truth = row["reward_model"]["ground_truth"]
    user = row["prompt"][0]
    extra = {
        **row["extra_info"],
        "need_tools_kwargs": True,
        "tools_kwargs": {GSM8K_TOOL_NAME: {"create_kwargs": {"ground_truth": truth}}},
        "interaction_kwargs": {"name": "gsm8k", "query": user["content"], "ground_truth": truth},
    }
    return {
        "data_source": row["data_source"],
        "agent_name": GSM8K_TOOL_AGENT,
        "prompt": [{"role": "system", "content": GSM8K_TOOL_SYSTEM_PROMPT}, user],
        "ability": row["ability"],
        "reward_model": row["reward_model"],
        "extra_info": extra,
    }


def math_row(record: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    _require(record, ("problem", "solution"), index, "math")
    truth = last_boxed(record["solution"])
    if truth is None:
        raise ValueError(f"math record {index}: solution has no \\boxed{{}} answer: {record['solution'][-80:]!r}")
    return {
        "data_source": MATH_SOURCE,
        "prompt": [{"role": "user", "content": f"{record['problem']} {MATH_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "level": str(record.get("level", "")),
                       "type": str(record.get("type", ""))},
    }


TASKS: dict[str, Callable[[dict[str, Any], str, int], dict[str, Any]]] = {
    "gsm8k": gsm8k_row, "gsm8k_multiturn": gsm8k_multiturn_row, "math": math_row, "geo3k": geo3k_row}
MEDIA_TASKS = ("geo3k",)  # records with images: relative image paths resolve from the input file's folder


def preprocess(task: str, input_path: str, output_dir: str, split: str = "train") -> str:
    """Convert `input_path` and write `<output_dir>/<split>.parquet`; returns the written path."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; legal: {sorted(TASKS)}")
    records = read_records(input_path)
    if not records:
        raise ValueError(f"input {input_path} holds no records")
    row_fn = TASKS[task]
    if task in MEDIA_TASKS:
        row_fn = functools.partial(row_fn, base_dir=os.path.dirname(os.path.abspath(input_path)), file=input_path)
    rows = [row_fn(record, split, i) for i, record in enumerate(records)]
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(os.path.abspath(output_dir), f"{split}.parquet")
    tmp = f"{path}.tmp-{os.getpid()}"  # write then rename: a reader never sees a partial file
    # pyarrow infers plain `string` columns, as verl's files (written by `datasets`) have them.
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Convert a Hub export of GSM8K, MATH or Geometry3K into verl-layout parquet "
                                "(gsm8k_multiturn: GSM8K rows for the calc_gsm8k_reward tool agent).")
    p.add_argument("task", choices=sorted(TASKS))
    p.add_argument("--input", required=True, help="a .jsonl/.json (JSON lines) or .parquet file")
    p.add_argument("--output", required=True, help="output directory; writes <split>.parquet there")
    p.add_argument("--split", default="train", help="split name stored in extra_info and the file name")
    args = p.parse_args(argv)
    print(preprocess(args.task, args.input, args.output, args.split))


if __name__ == "__main__":
    main()
