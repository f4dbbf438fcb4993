"""The regression guard of rlsp's defaults: rlsp with its defaults, rlsp with hand-picked settings and TRL
on the same workload, in interleaved rounds; prints one JSON line with the medians and the ratios.

    python benchmarks/defaults_vs_trl.py --workload tiny --rounds 3
    PYTHONPATH=/tmp/trl_pkgs python benchmarks/defaults_vs_trl.py    # TRL installed beside rlsp

Each round runs, one after the other and each in a process of its own, `grpo_step.py --settings
defaults`, `grpo_step.py --settings hand-picked` and `trl_grpo_step.py` (skipped, and its ratios left
out, when TRL cannot be imported). Interleaving puts every variant under the same load from other jobs.
Reported per variant: the median over rounds of the median step time (steps 3..N) and of the whole
process's wall time (process start to exit: what a user waits for an 8-step run); ratios: defaults /
TRL (goal <= 0.8 in step time, <= 1.0 in wall time) and defaults / hand-picked (goal <= 1.05).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {"defaults": ["grpo_step.py", "--settings", "defaults"],
            "hand_picked": ["grpo_step.py", "--settings", "hand-picked"],
            "trl": ["trl_grpo_step.py"]}


def run_variant(args: list[str], workload: str) -> dict:
    """One process; its JSON line plus its wall time from start to exit."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, os.path.join(HERE, args[0]), *args[1:], "--workload", workload],
                         capture_output=True, text=True, check=True).stdout
    result = json.loads([line for line in out.splitlines() if line.startswith('{"')][-1])
    return {**result, "process_wall_s": round(time.perf_counter() - t0, 2)}


def median(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 4)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["tiny", "small"], default="tiny")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    names = [n for n in VARIANTS if n != "trl" or importlib.util.find_spec("trl") is not None]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            runs[name].append(run_variant(VARIANTS[name], args.workload))
    step = {n: median(r, "step_s_median") for n, r in runs.items()}
    wall = {n: median(r, "process_wall_s") for n, r in runs.items()}
    out = {"benchmark": "defaults_vs_trl", "workload": args.workload, "rounds": args.rounds,
           "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cpus",
           "step_s": step, "process_wall_s": wall,
           "step_s_each": {n: [x["step_s_median"] for x in r] for n, r in runs.items()},
           "auto": runs["defaults"][0].get("auto"),
           "defaults_over_hand_picked": round(step["defaults"] / step["hand_picked"], 3)}
    if "trl" in step:
        out["defaults_over_trl"] = round(step["defaults"] / step["trl"], 3)
        out["defaults_over_trl_wall"] = round(wall["defaults"] / wall["trl"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
