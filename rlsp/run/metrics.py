"""MetricsLogger: the run's per-step records, fanned out to the trackers named in `trainer.logger`
(rlsp/run/trackers.py), plus a reward plot at the end."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from rlsp.run.trackers import RunInfo, Tracker, build_trackers, check_trackers, to_record
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.trainer")


class MetricsLogger:
    def __init__(self, run_dir: str, sinks: list[str]) -> None:
        check_trackers(list(sinks))  # unknown names and missing libraries fail before any worker has the run's config
        self.run_dir = run_dir
        self.sinks = list(dict.fromkeys(sinks))
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.history: list[dict[str, Any]] = []
        self.trackers: dict[str, Tracker] = {}
        self._open = False
        self._plotting: threading.Thread | None = None

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

    def plot_rewards_in_background(self, filename: str = "reward.png") -> str | None:
        """`plot_rewards` on a thread of its own, so that matplotlib's import and the drawing (~0.5 s of
        CPU) overlap the end of the run (the workers' and Ray's shutdown, which mostly wait); the path it
        writes, or None when there is nothing to plot. `wait_plot()` waits for it."""
        if not any("reward/mean" in r for r in self.history):
            return None
        history = list(self.history)

        def draw() -> None:
            try:
                self.plot_rewards(filename, history)
            except Exception as exc:  # the run itself is done and saved: say so, do not fail it
                log.error("the reward plot was not written: %s: %s", type(exc).__name__, exc)
        self._plotting = threading.Thread(target=draw, name="rlsp-reward-plot")
        self._plotting.start()
        return os.path.join(self.run_dir, filename)

    def wait_plot(self) -> None:
        """Wait for the plot `plot_rewards_in_background` started, if any."""
        if self._plotting is not None:
            self._plotting.join()
            self._plotting = None

    def plot_rewards(self, filename: str = "reward.png", history: list[dict[str, Any]] | None = None) -> str | None:
        history = self.history if history is None else history
        points = [(r["step"], r["reward/mean"]) for r in history if "reward/mean" in r]
        if not points:
            return None
        from matplotlib.figure import Figure  # no pyplot: no global figure state, safe off the main thread

        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        ax.plot([p[0] for p in points], [p[1] for p in points], label="train reward/mean")
        val = [(r["step"], r["val/accuracy"]) for r in history if "val/accuracy" in r]
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
        return path
