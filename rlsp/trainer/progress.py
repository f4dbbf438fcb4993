"""What a person sees of a run on the terminal: a progress bar over the steps and a closing summary
(steps, wall time, reward first -> last, validation accuracy, where every output is)."""

from __future__ import annotations

import os
import time
from typing import Any

from tqdm import tqdm

from rlsp.utils.logging import RUN_LOG_NAME, STARTED_AT, terminal


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


def _first_last(history: list[dict[str, Any]], key: str) -> str | None:
    points = [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float))]
    if not points:
        return None
    (s0, v0), (s1, v1) = points[0], points[-1]
    return f"{v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})"


def format_summary(history: list[dict[str, Any]], first_step: int, total: int, train_s: float, wall_s: float,
                   run_dir: str, outputs: dict[str, str]) -> str:
    """The closing block: one headline, the curve's ends, then each output relative to the run dir."""
    done = [r for r in history if r["step"] >= first_step]
    step_s = [r["timing/step_s"] for r in done if isinstance(r.get("timing/step_s"), (int, float))]
    per_step = f"; {sum(step_s) / len(step_s):.2f} s/step" if step_s else ""
    span = f"steps {done[0]['step']}-{done[-1]['step']} of {total}" if done else f"no new steps of {total}"
    steps = f"{len(done)} step{'' if len(done) == 1 else 's'}"
    lines = [f"run complete: {steps} in {_duration(train_s)} ({span}{per_step}); "
             f"wall time {_duration(wall_s)} with start-up"]
    for key in ("reward/mean", "val/accuracy"):
        ends = _first_last(history, key)
        if ends:
            lines.append(f"  {key:<13} {ends}")
    root = os.path.abspath(run_dir)
    lines.append(f"  {'outputs':<13} {root}")
    for name, path in outputs.items():
        shown = os.path.relpath(path, root) if path.startswith(root + os.sep) else path
        lines.append(f"    {name:<13} {shown}")
    return "\n".join(lines)


class RunProgress:
    """A step bar on the terminal (only when it is one) plus the facts the summary needs."""

    def __init__(self, run_dir: str, first_step: int, total: int) -> None:
        self.run_dir, self.first_step, self.total = run_dir, first_step, total
        self.t0 = time.perf_counter()
        self.outputs: dict[str, str] = {}
        self.bar = tqdm(total=total, initial=first_step - 1, desc="rlsp", unit="step", file=terminal(),
                        dynamic_ncols=True, disable=None)

    def step_done(self, metrics: dict[str, Any]) -> None:
        shown = {"reward": f"{metrics['reward/mean']:.3f}"} if "reward/mean" in metrics else {}
        if "val/accuracy" in metrics:
            shown["val_acc"] = f"{metrics['val/accuracy']:.3f}"
        if "timing/step_s" in metrics:
            shown["step_s"] = f"{metrics['timing/step_s']:.2f}"
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

    def summary(self, history: list[dict[str, Any]], extra: dict[str, str]) -> str:
        outputs = {**self.outputs, **extra}
        log_file = os.path.join(os.path.abspath(self.run_dir), RUN_LOG_NAME)
        if os.path.exists(log_file):
            outputs["log"] = log_file
        return format_summary(history, self.first_step, self.total, time.perf_counter() - self.t0,
                              time.time() - STARTED_AT, self.run_dir, outputs)
