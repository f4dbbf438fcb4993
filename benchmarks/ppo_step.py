"""PPO step time on the GRPO benchmark's workload (16 prompts x 8 samples x <=32 new tokens, tiny
model, 2 workers) with a colocated critic: one JSON line with the median step time over steps 3+
split into generate / values / old+ref logprobs / critic update / actor update / weight sync.
Extra argv entries are config overrides (key=value), e.g. `critic.ulysses_sequence_parallel_size=2`.
"""

from __future__ import annotations

import json
import os
import platform
import sys

from grpo_step import median_of, overrides_for, run_workload

PPO = {**overrides_for("demo", ""), "algorithm.adv_estimator": "gae", "algorithm.lam": 0.95, "critic.optim.lr": 1e-3}


def main(argv: list[str]) -> None:
    history, layout, wall = run_workload(PPO, argv)
    keys = {"step_s_median": "timing/step_s", "gen_s": "timing/gen_s", "values_s": "timing/values_s",
            "old_logprob_s": "timing/old_logprob_s", "ref_s": "timing/ref_s",
            "update_critic_s": "timing/update_critic_s", "update_actor_s": "timing/update_actor_s",
            "weight_sync_s": "timing/weight_sync_s", "tokens_per_s": "throughput/tokens_per_s"}
    print(json.dumps({
        "benchmark": "ppo_step",
        "workload": "16 prompts x 8 samples x <=32 tokens, tiny qwen2, 2 workers, colocated critic",
        "sp": layout.sp_size, "critic_sp": layout.critic.sp_size, "steps": len(history),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        **{name: median_of(history, key) for name, key in keys.items()},
        "wall_s_incl_startup": round(wall, 1),
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
