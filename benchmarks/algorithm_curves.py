"""GRPO, DAPO, GSPO and CISPO side by side on the demo task: reward and validation curves over seeds.

Runs `python -m rlsp.main` (the default tiny CPU demo: arithmetic task, 16 prompts x 8 samples, 150 steps)
once per (algorithm, seed). Every algorithm takes 4 mini-batches per step (`ppo_mini_batch_size=4`), so
three of the four updates of a step are off-policy and the losses actually differ (with one on-policy
mini-batch every ratio is 1 and GRPO, CISPO and GSPO take the same gradient). Settings, each the paper's
(and verl's example's) choice on top of the demo's:

- `grpo`: PPO clip 0.2, token-mean, the demo's KL loss (0.01, low_var_kl);
- `dapo`: dynamic sampling (groups whose samples all score alike are dropped and more prompts drawn, at
  at most 20 generation rounds a step), clip-higher (0.2 / 0.28), token-mean, no KL loss;
- `gspo`: sequence-level ratio clipped at 3e-4 / 4e-4, seq-mean-token-mean, no KL loss;
- `cispo`: clipped importance weights (no lower bound, upper 0.2), token-mean, the demo's KL loss.

Prints one JSON line per run: mean reward over steps 1-10 and the last 10, validation accuracy (greedy,
every 10 steps) at the end and its best, the first step whose reward passed +0.3 over the start, wall
time, and the generation rounds spent (DAPO's extra generation: rounds / steps). A DAPO run whose dynamic
sampling runs dry (20 rounds without 16 informative prompts: the model answers the small task's prompts all
right or all wrong) ends there with that error, as verl's does; its line then says at which step
(`stopped_at_step`) and summarises the steps it trained.

    .venv/bin/python benchmarks/algorithm_curves.py [--algos grpo dapo] [--seeds 0 1 2] [--steps 150]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = {"actor_rollout_ref.actor.ppo_mini_batch_size": 4}
NO_KL = {"actor_rollout_ref.actor.use_kl_loss": "false"}
ALGOS = {
    "grpo": {},
    "dapo": {"algorithm.filter_groups.enable": "true", "algorithm.filter_groups.metric": "acc",
             "algorithm.filter_groups.max_num_gen_batches": 20, "actor_rollout_ref.actor.clip_ratio_low": 0.2,
             "actor_rollout_ref.actor.clip_ratio_high": 0.28, **NO_KL},
    "gspo": {"actor_rollout_ref.actor.policy_loss.loss_mode": "gspo", "actor_rollout_ref.actor.clip_ratio_low": 3e-4,
             "actor_rollout_ref.actor.clip_ratio_high": 4e-4,
             "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean", **NO_KL},
    "cispo": {"actor_rollout_ref.actor.policy_loss.loss_mode": "cispo", "actor_rollout_ref.actor.clip_ratio_low": 10,
              "actor_rollout_ref.actor.clip_ratio_high": 0.2},
}


def summarise(name: str, seed: int, rows: list[dict], wall_s: float) -> dict:
    """One run's numbers from its metrics.jsonl records."""
    rewards = [r["reward/mean"] for r in rows]
    start = sum(rewards[:10]) / len(rewards[:10])
    passed = next((i + 1 for i, x in enumerate(rewards) if x >= start + 0.3), None)
    vals = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    rounds = sum(r.get("train/num_gen_batches", 1.0) for r in rows)
    return {"algorithm": name, "seed": seed, "steps": len(rows), "reward_first10": round(start, 4),
            "reward_last10": round(sum(rewards[-10:]) / len(rewards[-10:]), 4),
            "val_acc_final": vals[-1][1] if vals else None, "val_acc_best": max(v for _, v in vals) if vals else None,
            "val_curve": vals, "plus_0_3_at_step": passed, "wall_s": round(wall_s, 1),
            "generation_rounds": rounds, "generation_rounds_per_step": round(rounds / max(len(rows), 1), 3)}


def run(name: str, seed: int, steps: int, out: str) -> dict:
    run_dir = os.path.join(out, f"{name}_seed{seed}")
    shutil.rmtree(run_dir, ignore_errors=True)
    args = {**COMMON, **ALGOS[name], "trainer.seed": seed, "trainer.total_training_steps": steps,
            "trainer.default_local_dir": run_dir, "trainer.logger": "[jsonl]", "trainer.plot": "false",
            "trainer.save_final_model": "false", "trainer.save_freq": -1}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rlsp.main", *(f"{k}={v}" for k, v in args.items())], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    dry = proc.returncode == 1 and "max_num_gen_batches" in proc.stdout + proc.stderr
    if proc.returncode != 0 and not dry:
        raise RuntimeError(f"{name} seed {seed}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {**summarise(name, seed, rows, time.perf_counter() - t0), "stopped_at_step": len(rows) + 1 if dry else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=list(ALGOS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default=os.path.join(ROOT, "outputs", "algorithm_curves"))
    args = parser.parse_args()
    for name in args.algos:
        for seed in args.seeds:
            print(json.dumps(run(name, seed, args.steps, args.out)), flush=True)


if __name__ == "__main__":
    main()
