"""Bytes that cross the driver per training step, on named workloads; prints one JSON line.

    python benchmarks/driver_bytes.py --workload tiny-grpo   # grpo_step.py's tiny workload (HF generate), 4 steps
    python benchmarks/driver_bytes.py --workload tiny-ppo    # the same with a critic (GAE, lam 0.95)
    python benchmarks/driver_bytes.py --workload tiny-async  # the same on the asynchronous pipeline (1 trainer + 1 rollout worker)
    python benchmarks/driver_bytes.py --workload small-grpo  # grpo_step.py's small workload (256 tokens, vLLM), 2 steps
    python benchmarks/driver_bytes.py --workload small-ppo   # the same with a critic
    python benchmarks/driver_bytes.py --workload large-grpo  # tiny model, 128 prompts x 8 samples x 1024 forced tokens, 2 steps
    python benchmarks/driver_bytes.py --workload large-ppo   # the same with a critic (GAE)
    python benchmarks/driver_bytes.py --workload stage-grpo-kl --response-length 64  # the step stage's algorithms:
    #   stage-grpo-kl, stage-rloo-kl, stage-gpg-kl, stage-otb, stage-grpo-overlong (dapo's shaping), stage-distill
    #   (GRPO + on-policy distillation from a tiny teacher of other weights), stage-gdpo (two reward components),
    #   stage-correction (GRPO + the rollout correction), stage-otb-is (the optimal token baselines reading the
    #   correction's weights), stage-dapo-filter (dynamic sampling on seq_reward with dapo's overlong shaping),
    #   stage-remax (ReMax: a greedy response per prompt each step, its reward the samples' baseline):
    #   the tiny model, 8 prompts x 4 samples, forced lengths

Each workload runs `python -m rlsp.main` in a subprocess (cwd and PYTHONPATH: `--root`, this checkout by
default, so another checkout of rlsp can be measured with the same workloads) and reads the run's
metrics.jsonl: `perf/driver_bytes` (sent + received: arguments of worker calls and objects put, results
read), its split, `timing/step_s` and `perf/driver_peak_rss_gib` (the driver's peak resident memory,
the whole run so far). Step 1 also carries start-up traffic (worker set-up), so the JSON gives it apart
from the mean over steps 2..N, and `bytes_per_row` (that mean over the step's rows). Extra argv entries are
config overrides (key=value).

The `stage-*` workloads run an algorithm of the step stage (rlsp.workers.step_stage: an estimator with KL in
the reward, the optimal token baselines, GRPO with dapo's overlong shaping, gdpo), distillation's term
(rlsp.workers.stage_distill) or DAPO's dynamic sampling (rlsp.step.dynamic_sampling: its reward, the gdpo
workload's function, scores a continuous `score`, so nearly every group is informative; `gen_batches` is the
mean of train/num_gen_batches, and `bytes_per_row` is over the step's kept rows) at a forced response length
(`--response-length`, vLLM with ignore_eos): run one at two lengths; `bytes_per_row` stays the same when
nothing crosses the driver per token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from grpo_step import MODELS, overrides_for

from rlsp.models.tiny import TinyModelSpec, ensure_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPO = {"algorithm.adv_estimator": "gae", "algorithm.lam": 0.95, "critic.optim.lr": 1e-3,
       "critic.use_dynamic_bsz": True, "critic.ppo_max_token_len_per_gpu": 4096}
ASYNC = {"trainer.n_gpus_per_node": 1, "rollout.n_gpus_per_node": 1}
LARGE = {"data.train_batch_size": 128, "actor_rollout_ref.actor.ppo_mini_batch_size": 128,
         "data.max_response_length": 1024, "actor_rollout_ref.rollout.ignore_eos": True,
         "actor_rollout_ref.rollout.name": "vllm"}
# The step stage's workloads: forced lengths (vLLM, ignore_eos), a reference model for the KL in the reward.
STAGE = {"data.train_batch_size": 8, "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
         "actor_rollout_ref.rollout.ignore_eos": True, "actor_rollout_ref.rollout.name": "vllm"}
KL = {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 0.05, "actor_rollout_ref.actor.use_kl_loss": False}
OTB = {"algorithm.adv_estimator": "optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared": True}
OVERLONG = {"reward.reward_manager.name": "dapo", "reward.reward_kwargs.overlong_buffer_cfg.enable": True,
            "reward.reward_kwargs.overlong_buffer_cfg.len": 4, "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": 0.5}
# DAPO's dynamic sampling on the shaped token sums (verl's metric seq_reward), with the overlong shaping.
DAPO_FILTER = {**OVERLONG, "algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "seq_reward",
               "algorithm.filter_groups.max_num_gen_batches": 4}
# The rollout correction (rlsp.workers.stage_correction): token IS weights, batch-normalised, and token rejection.
CORRECTION = {"algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_is_batch_normalize": True,
              "algorithm.rollout_correction.rollout_rs": "token_k1", "algorithm.rollout_correction.rollout_rs_threshold": 2.0}
WORKLOADS = {  # name: (grpo_step.py workload, overrides on top, steps)
    "tiny-grpo": ("tiny", {}, 4), "tiny-ppo": ("tiny", PPO, 4), "tiny-async": ("tiny", ASYNC, 4),
    "small-grpo": ("small", {}, 2), "small-ppo": ("small", PPO, 2), "large-grpo": ("tiny", LARGE, 2),
    "large-ppo": ("tiny", {**LARGE, **PPO}, 2),
    "stage-grpo-kl": ("tiny", {**STAGE, **KL, "algorithm.adv_estimator": "grpo"}, 3),
    "stage-rloo-kl": ("tiny", {**STAGE, **KL, "algorithm.adv_estimator": "rloo"}, 3),
    "stage-gpg-kl": ("tiny", {**STAGE, **KL, "algorithm.adv_estimator": "gpg"}, 3),
    "stage-otb": ("tiny", {**STAGE, **OTB}, 3),
    "stage-grpo-overlong": ("tiny", {**STAGE, **OVERLONG, "algorithm.adv_estimator": "grpo"}, 3),
    "stage-dapo-filter": ("tiny", {**STAGE, **DAPO_FILTER, "algorithm.adv_estimator": "grpo"}, 3),
    "stage-remax": ("tiny", {**STAGE, "algorithm.adv_estimator": "remax"}, 3),
    "stage-correction": ("tiny", {**STAGE, **CORRECTION, "algorithm.adv_estimator": "grpo"}, 3),
    "stage-otb-is": ("tiny", {**STAGE, **OTB, **CORRECTION}, 3),
    "stage-distill": ("tiny", {**STAGE, "algorithm.adv_estimator": "grpo", "distillation.enabled": True}, 3),
    "stage-gdpo": ("tiny", {**STAGE, "algorithm.adv_estimator": "gdpo", "algorithm.gdpo_reward_weights": [1.0, 0.5],
                            "+algorithm.gdpo_reward_keys": ["accuracy_reward", "format_reward"]}, 3),
}
# stage-gdpo's reward function: two named components (rlsp.algos.gdpo normalises each within its group).
GDPO_REWARD = """def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    accuracy = float(solution_str.strip().startswith(str(ground_truth)))  # benchmarks/sum_prefix_reward.py's
    digits = float(sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1))
    return {"score": accuracy + digits, "accuracy_reward": accuracy, "format_reward": digits}
"""


def overrides(name: str, cache: str, steps: int | None, run_dir: str, response_length: int | None = None) -> dict:
    base, extra, default_steps = WORKLOADS[name]
    args = {**overrides_for(base, cache), **extra, "trainer.total_training_steps": steps or default_steps,
            "trainer.default_local_dir": run_dir}
    if response_length is not None:
        args["data.max_response_length"] = response_length
    if name.startswith(("large", "stage")):  # the tiny model with room for long responses (same weights: rope has none)
        spec = TinyModelSpec(**{**MODELS["tiny"].__dict__, "max_position_embeddings": 4096})
        args["actor_rollout_ref.model.path"] = ensure_tiny_model(os.path.join(cache, "bench-tiny-long"), spec)
    if name == "stage-distill":  # a teacher of the student's shape and vocabulary, other weights
        teacher = TinyModelSpec(**{**spec.__dict__, "seed": 1})
        args["distillation.teacher_models.teacher_model.model_path"] = ensure_tiny_model(
            os.path.join(cache, "bench-tiny-teacher"), teacher)
    if name in ("stage-gdpo", "stage-dapo-filter"):  # a reward whose score varies within a group
        path = os.path.join(cache, "gdpo_reward.py")
        with open(path, "w") as f:
            f.write(GDPO_REWARD)
        args["reward.custom_function_path"] = path
    return args


def cli_value(v) -> str:
    """A Hydra override's value: lists as [a,b], None as null, the rest as written."""
    if isinstance(v, list):
        return "[" + ",".join(map(str, v)) + "]"
    return "null" if v is None else str(v)


def run(args: dict, root: str, timeout_s: float) -> tuple[list[dict], float]:
    """Train in a subprocess; returns the metrics of each step and the wall seconds."""
    cmd = [sys.executable, "-m", "rlsp.main", *(f"{k}={cli_value(v)}" for k, v in args.items())]
    env = {**os.environ, "PYTHONPATH": root, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    t0 = time.perf_counter()
    run_dir = args["trainer.default_local_dir"]
    with open(run_dir + ".log", "w") as log:  # the run's output, beside its directory
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = "timeout"
        finally:  # Ctrl-C, as a user would: the run stops its own Ray and workers
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=120)
    if code != 0:
        raise SystemExit(f"exit {code}: {' '.join(cmd)}; output in {run_dir}.log")
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()], time.perf_counter() - t0


def summary(name: str, args: dict, rows: list[dict], wall: float, root: str) -> dict:
    later = rows[1:] or rows  # step 1 carries the start-up calls
    mean = lambda key: round(sum(r.get(key, 0.0) for r in later) / len(later), 4)  # noqa: E731
    return {"benchmark": "driver_bytes", "workload": name, "root": root, "steps": len(rows),
            "driver_bytes_step1": rows[0].get("perf/driver_bytes"), "driver_bytes_mean": mean("perf/driver_bytes"),
            "sent": mean("perf/driver_bytes_sent"), "received": mean("perf/driver_bytes_received"),
            "step_s": mean("timing/step_s"), "step1_s": round(rows[0]["timing/step_s"], 3),
            "driver_peak_rss_gib": round(max(r.get("perf/driver_peak_rss_gib", 0.0) for r in rows), 3),
            # samples of a step, and their tokens (prompt + response, mean over steps 2..N)
            "rows": (rows := int(args["data.train_batch_size"]) * int(args["actor_rollout_ref.rollout.n"])),
            "bytes_per_row": round(mean("perf/driver_bytes") / rows, 1),
            "response_length": args.get("data.max_response_length"),
            **({"gen_batches": mean("train/num_gen_batches")} if "train/num_gen_batches" in later[0] else {}),
            "tokens": round(sum(r["throughput/tokens_per_s"] * r["timing/step_s"] for r in later) / len(later)),
            "wall_s": round(wall, 1)}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=list(WORKLOADS), required=True)
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the workload's)")
    p.add_argument("--response-length", type=int, default=None, help="data.max_response_length (default: the workload's)")
    p.add_argument("--root", default=ROOT, help="the rlsp checkout to run (cwd and PYTHONPATH of the run)")
    p.add_argument("--out", default="/tmp/rlsp_driver_bytes", help="run directories go under here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the run is interrupted")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/rlsp/bench"))
    args, extra = p.parse_known_args(argv)
    os.makedirs(args.cache_dir, exist_ok=True)
    run_dir = os.path.join(args.out, args.workload)
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    root = os.path.abspath(args.root)
    run_args = overrides(args.workload, args.cache_dir, args.steps, run_dir, args.response_length)
    run_args.update(a.split("=", 1) for a in extra)  # extra overrides replace the workload's (rows counted from them)
    rows, wall = run(run_args, root, args.timeout)
    print(json.dumps(summary(args.workload, run_args, rows, wall, root)))


if __name__ == "__main__":
    main(sys.argv[1:])
