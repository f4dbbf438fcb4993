"""GRPO step time on the fixed workload: 16 prompts x 8 samples x <=32 new tokens, tiny model, 2 workers.

Prints one JSON line: median step time over steps 3+, the split between generation, logprob
recompute (old + ref), update and weight sync, and tokens/s. Extra argv entries are config overrides
(key=value), e.g. `actor_rollout_ref.actor.ulysses_sequence_parallel_size=2`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from omegaconf import OmegaConf  # noqa: E402

from rlsp.config.schema import RLSPConfig  # noqa: E402
from rlsp.config.validate import validate_config  # noqa: E402
from rlsp.main import train  # noqa: E402
from rlsp.trainer.preflight import preflight  # noqa: E402

WORKLOAD = {
    "data.train_batch_size": 16,
    "data.max_response_length": 32,
    "actor_rollout_ref.rollout.n": 8,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
    "actor_rollout_ref.actor.optim.lr": 1e-3,
    "trainer.n_gpus_per_node": 2,
    "trainer.device": "cpu",
    "trainer.total_training_steps": 8,
    "trainer.test_freq": 0,
    "trainer.val_before_train": False,
    "trainer.logger": ["jsonl"],
    "trainer.plot": False,
}


def run_workload(workload: dict, argv: list[str]):
    """Train with `workload` + argv overrides; returns (per-step metrics, layout, wall seconds)."""
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {**workload, "trainer.default_local_dir": tempfile.mkdtemp(prefix="rlsp_bench_")}.items():
        OmegaConf.update(cfg, key, val)
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(argv))
    layout = validate_config(cfg)
    cfg = preflight(cfg)
    t0 = time.perf_counter()
    history = train(cfg, layout)
    return history, layout, time.perf_counter() - t0


def median_of(history: list[dict], key: str, skip: int = 2) -> float:
    """Median of a per-step metric over the steps after the first `skip` (warm-up)."""
    return round(statistics.median(h.get(key, 0.0) for h in history[skip:]), 4)


def main(argv: list[str]) -> None:
    history, layout, wall = run_workload(WORKLOAD, argv)
    steady = history[2:]

    def med(key: str) -> float:
        return median_of(history, key)

    print(json.dumps({
        "benchmark": "grpo_step",
        "workload": "16 prompts x 8 samples x <=32 tokens, tiny qwen2, 2 workers",
        "sp": layout.sp_size, "steps": len(history), "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "step_s_median": med("timing/step_s"), "gen_s": med("timing/gen_s"),
        "logprob_s": round(statistics.median(h["timing/old_logprob_s"] + h.get("timing/ref_s", 0.0) for h in steady), 4),
        "update_s": med("timing/update_actor_s"), "weight_sync_s": med("timing/weight_sync_s"),
        "tokens_per_s": med("throughput/tokens_per_s"), "wall_s_incl_startup": round(wall, 1),
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
