"""MetricsLogger: the run's per-step records, fanned out to the trackers named in `trainer.logger`
(rlsp/trainer/trackers.py), plus a reward plot at the end."""

from __future__ import annotations

import json
import os
from typing import Any

from rlsp.trainer.trackers import RunInfo, Tracker, build_trackers, check_trackers, to_record


class MetricsLogger:
    def __init__(self, run_dir: str, sinks: list[str]) -> None:
        check_trackers(list(sinks))  # unknown names and missing libraries fail before any worker starts
        self.run_dir = run_dir
        self.sinks = list(dict.fromkeys(sinks))
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.history: list[dict[str, Any]] = []
        self.trackers: dict[str, Tracker] = {}
        self._open = False

    def open(self, project: str = "rlsp", experiment: str | None = None, config: dict[str, Any] | None = None,
             start_step: int = 1) -> None:
        """Start every tracker for this run (a resumed run passes the step it continues from)."""
        if self._open:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        run = RunInfo(self.run_dir, project, experiment or os.path.basename(os.path.abspath(self.run_dir)),
                      config or {}, start_step, list(self.history))
        self.trackers = build_trackers(self.sinks, run)
        self._open = True

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self._open:
            self.open(start_step=step)
        self.history.append(to_record(step, metrics))
        for tracker in self.trackers.values():
            tracker.log(step, metrics)

    def close(self, ok: bool = True) -> None:
        """Finish every tracker; `ok=False` marks the run failed where the backend records that."""
        for tracker in self.trackers.values():
            tracker.close(ok)
        self.trackers, self._open = {}, False

    def locations(self) -> dict[str, str]:
        """Where each tracker wrote (for the run summary)."""
        return {k: v for tracker in self.trackers.values() for k, v in tracker.location().items()}

    def jsonl_lines(self) -> list[str]:
        """The records logged so far, one JSON line each (as metrics.jsonl holds them)."""
        return [json.dumps(r) + "\n" for r in self.history]

    def restore(self, records: list[dict[str, Any]]) -> None:
        """Continue a resumed run: the records of its checkpoint replace whatever was logged after it."""
        self.history = list(records)
        jsonl = self.trackers.get("jsonl")
        if jsonl is not None:
            jsonl.write_all(self.history)

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
