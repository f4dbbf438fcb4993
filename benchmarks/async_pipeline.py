"""Step throughput of the asynchronous pipeline against the synchronous colocated run on a
generation-heavy CPU workload (tiny model, 8 prompts x 4 samples x 128 forced tokens per step).

Runs `python -m rlsp.main` once per setting and prints one JSON line each: mean wall time per step
over steps 2..N (step 1 includes engine warm-up), rewards, staleness and each pool's idle share.

    .venv/bin/python benchmarks/async_pipeline.py [--steps 6] [--response-length 128] [--out /tmp/rlsp_async_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = {
    "trainer.device": "cpu", "data.train_batch_size": 8, "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 8, "data.max_response_length": 128,
    "actor_rollout_ref.rollout.ignore_eos": "true", "trainer.test_freq": 0, "trainer.val_before_train": "false",
    "trainer.save_final_model": "false", "trainer.plot": "false", "actor_rollout_ref.actor.optim.lr": 1e-3,
}
SETTINGS = {
    "sync colocated, 2 workers": {"trainer.n_gpus_per_node": 2},
    "sync colocated, 1 worker": {"trainer.n_gpus_per_node": 1},
    "async staleness 0, 1 trainer + 1 rollout": {"trainer.n_gpus_per_node": 1, "rollout.n_gpus_per_node": 1},
    "async staleness 1 (one-step off), 1 + 1": {"trainer.n_gpus_per_node": 1, "rollout.n_gpus_per_node": 1,
                                                "async_training.staleness_threshold": 1.0},
    "async staleness 1 + partial rollouts (16-token segments), 1 + 1": {
        "trainer.n_gpus_per_node": 1, "rollout.n_gpus_per_node": 1, "async_training.staleness_threshold": 1.0,
        "async_training.partial_rollout": "true", "async_training.partial_rollout_segment_tokens": 16},
}


def run(name: str, overrides: dict, steps: int, out: str) -> dict:
    run_dir = os.path.join(out, "".join(c if c.isalnum() else "_" for c in name))
    shutil.rmtree(run_dir, ignore_errors=True)
    args = {**WORKLOAD, **overrides, "trainer.total_training_steps": steps, "trainer.default_local_dir": run_dir,
            "trainer.cache_dir": os.path.join(out, "cache")}
    proc = subprocess.run([sys.executable, "-m", "rlsp.main", *(f"{k}={v}" for k, v in args.items())], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steady = rows[1:]
    mean = lambda key: sum(r[key] for r in steady) / len(steady) if key in steady[0] else None  # noqa: E731
    return {"setting": name, "steps": steps, "step_s_mean": mean("timing/step_s"), "gen_s_mean": mean("timing/gen_s"),
            "update_actor_s_mean": mean("timing/update_actor_s"), "reward_mean": mean("reward/mean"),
            "staleness_max": max((r.get("async/staleness_max", 0.0) for r in rows), default=0.0),
            "trainer_idle_ratio": rows[-1].get("async/trainer_idle_ratio"),
            "rollout_idle_ratio": rows[-1].get("async/rollout_idle_ratio"),
            "partial_fraction_mean": mean("async/partial_fraction"),
            "version_span_max": max((r.get("async/version_span_max", 0.0) for r in rows), default=0.0)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="/tmp/rlsp_async_bench")
    parser.add_argument("--only", default=None, help="run the settings whose name contains this")
    parser.add_argument("--response-length", type=int, default=WORKLOAD["data.max_response_length"],
                        help="forced tokens per sample (generation weight of the step)")
    a = parser.parse_args()
    for name, overrides in SETTINGS.items():
        if a.only is None or a.only in name:
            sized = {**overrides, "data.max_response_length": a.response_length}
            print(json.dumps({**run(name, sized, a.steps, a.out), "response_length": a.response_length}), flush=True)


if __name__ == "__main__":
    main()
