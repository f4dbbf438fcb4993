"""Does the demo task still learn off-policy? recipes/grpo_async_cpu (1 trainer + 1 rollout worker, tiny
model, 150 steps) at staleness 0, 1 and 2, with and without the rollout correction, over a few seeds.

Runs the recipe once per (setting, seed) and prints one JSON line each: mean reward over the first 10
and the last 20 steps, validation accuracy at the end and its best, the staleness the run actually had,
and the mean |rollout - trainer logprob| gap. Settings:

- `sync`: staleness_threshold=0 (the synchronous pipeline), with the recipe's correction;
- `stale1+corr`, `stale2+corr`: decoupled PPO (rollout logprobs as the behaviour policy, the trainer's
  recomputed proximal policy, token-level truncated importance weights, token_k1 rejection);
- `stale2 recompute`: staleness 2 with the trainer's recomputed old logprobs and no correction (the
  behaviour/proximal mismatch ignored);
- `stale2 bypass`: staleness 2 with the rollout logprobs as the PPO old logprobs and no correction
  (the ratio is taken against the stale behaviour policy: naive off-policy PPO).

    .venv/bin/python benchmarks/async_learning.py [--seeds 1 2] [--steps 150] [--only stale2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_CORRECTION = {"algorithm.rollout_correction.rollout_is": "null", "algorithm.rollout_correction.rollout_rs": "null",
                 "algorithm.rollout_correction.rollout_rs_threshold": "null",
                 "async_training.compute_prox_log_prob": "false"}
SETTINGS = {
    "sync": {"async_training.staleness_threshold": 0.0},
    "stale1+corr": {"async_training.staleness_threshold": 1.0},
    "stale2+corr": {"async_training.staleness_threshold": 2.0},
    "stale2 recompute": {"async_training.staleness_threshold": 2.0, "async_training.use_rollout_log_probs": "false",
                         **NO_CORRECTION},
    "stale2 bypass": {"async_training.staleness_threshold": 2.0, **NO_CORRECTION},
}


def run(name: str, overrides: dict, seed: int, steps: int, out: str) -> dict:
    run_dir = os.path.join(out, "".join(c if c.isalnum() else "_" for c in name) + f"_seed{seed}")
    shutil.rmtree(run_dir, ignore_errors=True)
    args = {**overrides, "trainer.seed": seed, "trainer.total_training_steps": steps, "trainer.default_local_dir": run_dir,
            "trainer.cache_dir": os.path.join(out, "cache"), "trainer.logger": "[jsonl]", "trainer.plot": "false",
            "trainer.save_final_model": "false"}
    proc = subprocess.run(["bash", "recipes/grpo_async_cpu/run.sh", *(f"{k}={v}" for k, v in args.items())], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    vals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    return {"setting": name, "seed": seed, "steps": len(rows), "reward_first10": mean(rows[:10], "reward/mean"),
            "reward_last20": mean(rows[-20:], "reward/mean"), "val_acc_final": vals[-1] if vals else None,
            "val_acc_best": max(vals) if vals else None,
            "staleness_max": max(r.get("async/staleness_max", 0.0) for r in rows),
            "staleness_mean": mean(rows, "async/staleness_mean") if "async/staleness_mean" in rows[0] else 0.0,
            "logprob_gap_mean": mean(rows, "rollout/logprob_diff")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default="/tmp/rlsp_async_learning")
    parser.add_argument("--only", default=None, help="run the settings whose name contains this")
    a = parser.parse_args()
    for name, overrides in SETTINGS.items():
        if a.only and a.only not in name:
            continue
        for seed in a.seeds:
            print(json.dumps(run(name, overrides, seed, a.steps, a.out)), flush=True)


if __name__ == "__main__":
    main()
