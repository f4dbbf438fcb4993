"""Greedy accuracy of SmolLM2-135M-Instruct on held-out word problems, before any training.

The held-out split of `builtin://word_problems/test` (the recipe's validation set), rendered with the
model's chat template, decoded greedily with up to `--max-tokens` new tokens and scored with the
gsm8k scorer: strict (`#### N`, what training rewards) and flexible (last number). Prints one JSON
line; `--show N` prints N example responses to stderr first.

Usage: `python benchmarks/smollm2_baseline.py [--engine vllm|hf] [--max-tokens 64] [--n 128]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pandas as pd  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rlsp.data.dataset import PromptDataset  # noqa: E402
from rlsp.data.tasks.word_problems import write_word_problems_parquet  # noqa: E402
from rlsp.rewards.gsm8k import score_gsm8k  # noqa: E402
from rlsp.rollout import SamplingConfig, build_rollout_engine  # noqa: E402
from rlsp.run.assets import resolve_data_files, resolve_model_path  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin://smollm2-135m-instruct")
    p.add_argument("--data", default="builtin://word_problems/test")
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-length", type=int, default=128)
    p.add_argument("--n", type=int, default=128, help="number of held-out problems")
    p.add_argument("--cache-dir", default="~/.cache/rlsp")
    p.add_argument("--instruction", default=None, help="regenerate the problems with this instruction instead")
    p.add_argument("--show", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = _parse(argv)
    t0 = time.perf_counter()
    model = resolve_model_path(args.model, args.cache_dir)
    if args.instruction is not None:
        data = write_word_problems_parquet(tempfile.mkdtemp(prefix="rlsp_wp_"), instruction=args.instruction)[1]
    else:
        (data,) = resolve_data_files(args.data, args.cache_dir)
    t_model = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = PromptDataset(data, tokenizer, max_prompt_length=args.max_prompt_length, filter_overlong=False)
    items = [dataset[i] for i in range(min(args.n, len(dataset)))]
    kwargs = {"dtype": "float32", "max_model_len": args.max_prompt_length + args.max_tokens, "seed": 0}
    if args.engine == "hf":
        kwargs["device"] = "cpu"
    engine = build_rollout_engine(args.engine, model, **kwargs)
    t1 = time.perf_counter()
    out = engine.generate([it["prompt_ids"] for it in items], SamplingConfig(max_tokens=args.max_tokens).greedy())
    t_gen = time.perf_counter() - t1
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out.response_ids]
    truths = [it["ground_truth"] for it in items]
    strict = [score_gsm8k(t, g, "strict") for t, g in zip(texts, truths)]
    flexible = [score_gsm8k(t, g, "flexible") for t, g in zip(texts, truths)]
    for text, item, s in list(zip(texts, items, strict))[: args.show]:
        print(f"--- truth {item['ground_truth']} strict {s}\n{text}", file=sys.stderr)
    print(json.dumps({
        "benchmark": "smollm2_baseline",
        "model": args.model,
        "engine": args.engine,
        "n_problems": len(items),
        "max_new_tokens": args.max_tokens,
        "prompt_example": pd.read_parquet(data)["prompt"].iloc[0][0]["content"],
        "accuracy_strict": round(sum(strict) / len(items), 4),
        "accuracy_flexible": round(sum(flexible) / len(items), 4),
        "truncated_fraction": round(sum(f == "length" for f in out.finish_reason) / len(items), 4),
        "mean_response_tokens": round(sum(map(len, out.response_ids)) / len(items), 1),
        "generate_s": round(t_gen, 2),
        "model_resolve_s": round(t_model, 2),
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
