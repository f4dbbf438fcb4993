"""GRPO step time on fixed workloads (the ones rlsp is compared with TRL on); prints one JSON line.

    python benchmarks/grpo_step.py --workload tiny    # Qwen2 2 layers, hidden 128, 4q/2kv, <=32 new tokens, 8 steps
    python benchmarks/grpo_step.py --workload small   # Qwen2 8 layers, hidden 512, 8q/2kv (~22.5M), 256 tokens, 4 steps
    python benchmarks/grpo_step.py --workload demo    # the tiny demo model/task with KL (earlier numbers)

Workloads tiny/small: random-init Qwen2ForCausalLM (vocab 128, tied embeddings, torch.manual_seed(0)
init via the tiny-model factory, char tokenizer); 128 prompts "a+b=" (a, b from
random.Random(0).randint(0, 9), tokenized as written); reward 1 if the completion starts with the sum;
16 prompts x 8 samples per step, temperature 1, lr 1e-4 constant, grad clip 1.0, no KL, one optimizer
step per batch, fp32; small ignores EOS (always 256 tokens). `--settings defaults` (the default) passes
only these workload keys: rlsp chooses the rest itself (its `auto` settings, rlsp.config.auto, listed in
the JSON's "auto"). `--settings hand-picked` adds the settings chosen by hand for this CPU work (all
exact): every worker holding the whole model (fsdp_size=1: only gradients are reduced), micro-batches of
<= 4096 tokens, rollouts with the hf engine (transformers' model, rlsp's decoding loop) for tiny and vLLM for small (ignore_eos). Both run
2 workers of 1 thread each. The JSON holds the median over steps 3..N of the step time and of each
phase (the update split into forward, backward and optimizer on the slowest worker), the start-up
(process start to the end of step 1) with its split (driver imports; the checks, with Ray starting
beside them as in `python -m rlsp.main`: `checks_s`, `ray_init_s`, and `ray_wait_s` for Ray after the
checks; worker processes up; worker set-up; step 1), and the run's share of the cores during the measured steps with the load
average (other jobs on the cores slow every phase), and the driver's remote calls and round trips per step
(`driver_calls`, `driver_waits`). Extra argv entries are config overrides (key=value).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time

PROCESS_START = time.time()  # before the heavy imports: start-up is measured from here
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pandas as pd  # noqa: E402
import psutil  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

# Only what `python -m rlsp.main` imports before its checks: torch, transformers and the worker stack come
# with the checks, while Ray starts beside them (rlsp.controller.ray_session), as in a user's run.
from rlsp.config.schema import RLSPConfig  # noqa: E402
from rlsp.config.validate import validate_config  # noqa: E402
from rlsp.controller.ray_session import RayStart  # noqa: E402
from rlsp.main import _prepare_checked, train  # noqa: E402
from rlsp.models.tiny import TinyModelSpec, ensure_tiny_model  # noqa: E402
from rlsp.utils.fast_exit import run_and_exit  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = {
    "data.train_batch_size": 16, "actor_rollout_ref.rollout.n": 8,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 16, "trainer.n_gpus_per_node": 2, "trainer.device": "cpu",
    "trainer.test_freq": 0, "trainer.val_before_train": False, "trainer.logger": ["jsonl"], "trainer.plot": False,
    "trainer.save_final_model": False,
}
MODELS = {
    "tiny": TinyModelSpec(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128, seed=0),
    "small": TinyModelSpec(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, seed=0),
}
WORKLOADS = {
    "tiny": {"steps": 8, "max_response_length": 32, "ignore_eos": False, "rollout": "hf"},
    "small": {"steps": 4, "max_response_length": 256, "ignore_eos": True, "rollout": "vllm"},
}
PHASES = {"step_s_median": "timing/step_s", "gen_s": "timing/gen_s", "old_logprob_s": "timing/old_logprob_s",
          "ref_s": "timing/ref_s", "reward_s": "timing/reward_s", "update_s": "timing/update_actor_s",
          "weight_sync_s": "timing/weight_sync_s", "update_forward_s": "timing/actor_forward_s",
          "update_backward_s": "timing/actor_backward_s", "update_optimizer_s": "timing/actor_optimizer_s",
          "tokens_per_s": "throughput/tokens_per_s", "driver_calls": "perf/driver_calls",
          "driver_waits": "perf/driver_waits"}


def sum_prompts(path: str) -> str:
    rng = random.Random(0)
    rows = []
    for i in range(128):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"data_source": "benchmark/sum_prefix", "prompt": f"{a}+{b}=",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": i}})
    pd.DataFrame(rows).to_parquet(path)
    return path


def overrides_for(workload: str, cache: str, settings: str = "defaults") -> dict:
    if workload == "demo":  # the demo model and task, with the reference and KL loss
        return {**COMMON, "data.max_response_length": 32, "actor_rollout_ref.actor.optim.lr": 1e-3,
                "trainer.total_training_steps": 8}
    w = WORKLOADS[workload]
    model = ensure_tiny_model(os.path.join(cache, f"bench-{workload}"), MODELS[workload])
    data = sum_prompts(os.path.join(cache, "sum_prompts.parquet"))
    return {**COMMON, "actor_rollout_ref.model.path": model, "data.train_files": data, "data.val_files": None,
            "data.apply_chat_template": False, "data.max_prompt_length": 8,
            "data.max_response_length": w["max_response_length"], "actor_rollout_ref.rollout.ignore_eos": w["ignore_eos"],
            "actor_rollout_ref.actor.optim.lr": 1e-4, "actor_rollout_ref.actor.optim.grad_clip": 1.0,
            "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.actor.entropy_coeff": 0.0,
            "reward.custom_function_path": os.path.join(HERE, "sum_prefix_reward.py"),
            "trainer.total_training_steps": w["steps"],
            **(hand_picked(workload) if settings == "hand-picked" else {})}


def hand_picked(workload: str) -> dict:
    """The settings chosen by hand for this CPU work (the defaults choose for themselves)."""
    return {"actor_rollout_ref.actor.fsdp_config.fsdp_size": 1, "actor_rollout_ref.rollout.name": WORKLOADS[workload]["rollout"],
            "actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096}


def cpu_seconds() -> float:
    """CPU seconds used so far by this process and everything it started (Ray's services, the workers)."""
    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # ended meanwhile
            pass
    return total


def watch_cpu(trainer, samples: list[tuple[float, float]]) -> None:
    """Record (CPU seconds of the run, wall seconds) per step: on a shared machine the run's share of
    the cores says how much other jobs took from it."""
    step_fn = trainer.train_step

    def train_step(step, items):
        c0, w0 = cpu_seconds(), time.perf_counter()
        out = step_fn(step, items)
        samples.append((cpu_seconds() - c0, time.perf_counter() - w0))
        return out

    trainer.train_step = train_step


def run_workload(workload: dict, argv: list[str]):
    """Train with `workload` + argv overrides; returns (per-step metrics, layout, wall seconds, time.time()
    at the end of step 1, (CPU seconds, wall seconds) per step, the `auto` settings chosen)."""
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {**workload, "trainer.default_local_dir": tempfile.mkdtemp(prefix="rlsp_bench_")}.items():
        OmegaConf.update(cfg, key, val)
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(argv))
    auto: list = []
    layout = validate_config(cfg, auto)
    t0 = time.perf_counter()
    ray_start = RayStart(cfg, layout)  # as rlsp.main: Ray comes up while the checks run
    prepared = _prepare_checked(cfg, layout)
    prepared[0].startup["startup/checks_s"] = time.perf_counter() - t0  # preflight, datasets, resume (imports incl.)
    cpu: list[tuple[float, float]] = []
    watch_cpu(prepared[0], cpu)
    history = train(cfg, layout, prepared, ray_start)
    return history, layout, time.perf_counter() - t0, prepared[0].first_step_done_at, cpu, auto


def traffic():
    from rlsp.controller.traffic import TRAFFIC  # torch: imported with the checks

    return TRAFFIC


def median_of(history: list[dict], key: str, skip: int = 2) -> float:
    """Median of a per-step metric over the steps after the first `skip` (warm-up)."""
    return round(statistics.median(h.get(key, 0.0) for h in history[skip:]), 4)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["tiny", "small", "demo"], default="tiny")
    p.add_argument("--settings", choices=["defaults", "hand-picked"], default="defaults",
                   help="defaults: only the workload's keys, rlsp chooses the rest; hand-picked: the settings below")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/rlsp/bench"))
    args, overrides = p.parse_known_args(argv)
    os.makedirs(args.cache_dir, exist_ok=True)
    imported_s = time.time() - PROCESS_START
    load_before = os.getloadavg()[0]
    history, layout, wall, first_step_end, cpu, auto = run_workload(overrides_for(args.workload, args.cache_dir, args.settings), overrides)
    # process start to the end of step 1 (imports, Ray, workers, engines, step 1: what a user waits for)
    first_step_done = first_step_end - PROCESS_START
    print(json.dumps({
        "benchmark": "grpo_step", "workload": args.workload, "settings": args.settings, "overrides": overrides,
        "auto": {c.key.rsplit(".", 2)[-2] + "." + c.key.rsplit(".", 1)[-1]: c.value for c in auto},
        "sp": layout.actor.sp_size, "workers": layout.world_size, "steps": len(history),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        **{name: median_of(history, key) for name, key in PHASES.items()},
        "startup_to_first_step_s": round(first_step_done, 2),
        "driver_imports_s": round(imported_s, 2),
        # its split (the rest: driver imports and set-up before Ray, and step 1 itself)
        **{k.split("/")[1]: round(v, 2) for k, v in history[0].items() if k.startswith("startup/")},
        "step1_s": round(history[0]["timing/step_s"], 2),
        "wall_s_incl_startup": round(wall, 1),
        # share of all cores this run used during steps 3..N (~0.9 when the machine is its own), and
        # the 1-minute load average before and after: other jobs on the cores slow every phase
        "driver_calls_last_step": traffic().last_by_method,
        "cpu_share": round(sum(c for c, _ in cpu[2:]) / max(1e-9, sum(w for _, w in cpu[2:]) * (os.cpu_count() or 1)), 2),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }))


if __name__ == "__main__":
    run_and_exit(lambda: main(sys.argv[1:]))  # exits as `python -m rlsp.main` does (no interpreter teardown)
