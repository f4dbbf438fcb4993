"""The same GRPO workloads as benchmarks/grpo_step.py, run by Hugging Face TRL's `GRPOTrainer`; one JSON line.

    python benchmarks/trl_grpo_step.py --workload tiny    # 8 steps
    python benchmarks/trl_grpo_step.py --workload small   # 4 steps, EOS ignored (always 256 new tokens)

The baseline rlsp is compared with, measured on the same machine in the same period as rlsp's numbers
(docs/benchmarks.md). TRL is not a dependency of rlsp: install it beside rlsp's environment, e.g.
`pip install --target /tmp/trl_pkgs --no-deps trl==1.16.0 datasets dill multiprocess xxhash` and run
with `PYTHONPATH=/tmp/trl_pkgs`.

Same work as grpo_step.py: the same model directory (random-init Qwen2 from rlsp's tiny-model factory,
vocab 128, char tokenizer), the same 128 prompts "a+b=" (completion-style, no chat template), the same
reward (benchmarks/sum_prefix_reward.py), 16 prompts x 8 samples per step, temperature 1, lr 1e-4
constant, grad clip 1.0, no KL (beta 0), one optimizer step per batch (num_iterations 1), fp32. TRL
stock settings otherwise: one process on every core, transformers `generate`, gradient checkpointing
off. Reported: the median step time over steps 3..N (wall time between optimizer steps, generation
included) and the whole process's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

PROCESS_START = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import grpo_step  # noqa: E402  (the workloads' model and prompts)
from sum_prefix_reward import compute_score  # noqa: E402

from rlsp.models.tiny import ensure_tiny_model  # noqa: E402

try:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # not an rlsp dependency
    raise SystemExit(f"{exc}: install TRL beside rlsp to run this baseline (see the module docstring)") from exc


class StepTimes(TrainerCallback):
    """Wall time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001 (transformers' signature)
        self.ends.append(time.time())


def reward(completions: list[str], ground_truth: list[str], **_: object) -> list[float]:
    return [compute_score("benchmark/sum_prefix", c, g) for c, g in zip(completions, ground_truth)]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=list(grpo_step.WORKLOADS), default="tiny")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/rlsp/bench"))
    args = p.parse_args(argv)
    w = grpo_step.WORKLOADS[args.workload]
    os.makedirs(args.cache_dir, exist_ok=True)
    model_dir = ensure_tiny_model(os.path.join(args.cache_dir, f"bench-{args.workload}"), grpo_step.MODELS[args.workload])
    import pandas as pd  # noqa: PLC0415

    rows = pd.read_parquet(grpo_step.sum_prompts(os.path.join(args.cache_dir, "sum_prompts.parquet")))
    data = Dataset.from_dict({"prompt": list(rows["prompt"]),
                              "ground_truth": [r["ground_truth"] for r in rows["reward_model"]]})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    gen_kwargs = {"min_new_tokens": w["max_response_length"]} if w["ignore_eos"] else {}
    config = GRPOConfig(
        output_dir=os.path.join(args.cache_dir, f"trl-{args.workload}"), max_steps=w["steps"],
        per_device_train_batch_size=128, gradient_accumulation_steps=1, num_generations=8,
        max_completion_length=w["max_response_length"], temperature=1.0, learning_rate=1e-4,
        lr_scheduler_type="constant", max_grad_norm=1.0, beta=0.0, num_iterations=1, use_vllm=False,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, seed=0, generation_kwargs=gen_kwargs, disable_tqdm=True,
    )
    times = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[times])
    start = time.time()
    trainer.train()
    steps = [b - a for a, b in zip([start, *times.ends[:-1]], times.ends)]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    print(json.dumps({
        "benchmark": "trl_grpo_step", "workload": args.workload, "trl": __import__("trl").__version__,
        "steps": len(steps), "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "step_s_median": round(statistics.median(steps[2:]), 4), "step_s": [round(s, 3) for s in steps],
        "step1_s": round(steps[0], 2), "startup_to_first_step_s": round(times.ends[0] - PROCESS_START, 2),
        "wall_s_incl_startup": round(time.time() - PROCESS_START, 1), "reward_per_step": [h["reward"] for h in logs],
        "completion_mean_length": [h["completions/mean_length"] for h in logs],
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
