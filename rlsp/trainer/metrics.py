"""Metrics sinks: a console line per step, metrics.jsonl (one object per step), a reward plot at the end."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from rlsp.utils.logging import get_logger

log = get_logger("rlsp.metrics")

CONSOLE_KEYS = (
    "reward/mean", "val/accuracy", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
    "rollout/logprob_diff", "response_length/mean", "timing/step_s", "throughput/tokens_per_s",
)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    def __init__(self, run_dir: str, sinks: list[str]) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.sinks = set(sinks)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.history: list[dict[str, Any]] = []
        if "jsonl" in self.sinks:
            open(self.path, "w").close()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        self.history.append(record)
        if "jsonl" in self.sinks:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if "console" in self.sinks:
            shown = " ".join(f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS if isinstance(metrics.get(k), (int, float)))
            log.info("step %d | %s", step, shown)

    def jsonl_lines(self) -> list[str]:
        """The records logged so far, one JSON line each (as metrics.jsonl holds them)."""
        return [json.dumps(r) + "\n" for r in self.history]

    def restore(self, records: list[dict[str, Any]]) -> None:
        """Continue a resumed run: the records of its checkpoint replace whatever was logged after it."""
        self.history = list(records)
        if "jsonl" in self.sinks:
            with open(self.path, "w") as f:
                f.writelines(self.jsonl_lines())

    def plot_rewards(self, filename: str = "reward.png") -> str | None:
        points = [(r["step"], r["reward/mean"]) for r in self.history if "reward/mean" in r]
        if not points:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([p[0] for p in points], [p[1] for p in points], label="train reward/mean")
        val = [(r["step"], r["val/accuracy"]) for r in self.history if "val/accuracy" in r]
        if val:
            ax.plot([p[0] for p in val], [p[1] for p in val], "o--", label="val/accuracy")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(self.run_dir, filename)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
