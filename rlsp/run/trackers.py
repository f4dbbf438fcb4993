"""Experiment trackers behind `trainer.logger`: one thin adapter per backend over the library itself.

    console      one line per step through rlsp's logger (printed above the progress bar)
    jsonl        <run_dir>/metrics.jsonl, one JSON object per step (rlsp's own record; checkpoints keep it)
    tensorboard  torch.utils.tensorboard.SummaryWriter -> <run_dir>/tensorboard
    wandb        wandb.init(dir=<run_dir>), offline unless WANDB_MODE says otherwise -> <run_dir>/wandb
    mlflow       MlflowClient on MLFLOW_TRACKING_URI, else a local store sqlite:///<run_dir>/mlflow.db

Every adapter takes the run's identity once (`RunInfo`) and then gets `log(step, metrics)` per step
and `close(ok)` at the end. The libraries are imported when their tracker is built, so a run that
does not ask for one never imports it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlsp.config.choices import LOGGERS
from rlsp.utils.dicts import flatten
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.metrics")

# What the console line shows of a step, under short names (every metric is in the other trackers).
CONSOLE_KEYS = {
    "reward/mean": "reward", "val/accuracy": "val_acc", "actor/pg_loss": "pg_loss", "actor/kl_loss": "kl_loss",
    "actor/entropy": "entropy", "critic/vf_loss": "vf_loss", "rollout/logprob_diff": "lp_diff",
    "response_length/mean": "resp_len", "timing/step_s": "step_s",
}
# The modules each library-backed tracker imports -> the pip package that provides it.
REQUIRES = {
    "tensorboard": {"tensorboard": "tensorboard"},
    "wandb": {"wandb": "wandb"},
    "mlflow": {"mlflow": "mlflow-skinny", "sqlalchemy": "sqlalchemy", "alembic": "alembic"},  # sqlite store
}


@dataclass
class RunInfo:
    run_dir: str
    project: str
    experiment: str
    config: dict[str, Any] = field(default_factory=dict)
    start_step: int = 1  # > 1 when the run resumes from a checkpoint
    history: list[dict[str, Any]] = field(default_factory=list)  # records already logged (restored)


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self, ok: bool) -> None: ...

    def location(self) -> dict[str, str]: ...


def to_record(step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """One step as JSON can hold it (non-finite floats as strings)."""
    return {"step": step, **{k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
                             for k, v in sorted(metrics.items())}}


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


class ConsoleTracker:
    def __init__(self, run: RunInfo) -> None:
        pass

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        shown = " ".join(f"{name}={metrics[k]:.3g}" for k, name in CONSOLE_KEYS.items()
                         if isinstance(metrics.get(k), (int, float)))
        log.info("step %d | %s", step, shown)

    def close(self, ok: bool) -> None:
        pass

    def location(self) -> dict[str, str]:
        return {}


class JsonlTracker:
    def __init__(self, run: RunInfo) -> None:
        self.path = os.path.join(os.path.abspath(run.run_dir), "metrics.jsonl")
        self.write_all(run.history)

    def write_all(self, records: list[dict[str, Any]]) -> None:
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(to_record(step, metrics)) + "\n")

    def close(self, ok: bool) -> None:
        pass

    def location(self) -> dict[str, str]:
        return {"metrics": self.path}


class TensorBoardTracker:
    def __init__(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = os.path.join(os.path.abspath(run.run_dir), "tensorboard")
        # purge_step hides what an earlier attempt in this directory logged from this step on.
        self.writer = SummaryWriter(log_dir=self.dir, purge_step=run.start_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, ok: bool) -> None:
        self.writer.close()

    def location(self) -> dict[str, str]:
        return {"tensorboard": self.dir}


class WandbTracker:
    def __init__(self, run: RunInfo) -> None:
        import wandb

        # Offline by default: needs no account or network; `wandb sync <dir>` uploads it later.
        self.run = wandb.init(project=run.project, name=run.experiment, dir=os.path.abspath(run.run_dir),
                              config=run.config, mode=os.environ.get("WANDB_MODE") or "offline",
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)

    def location(self) -> dict[str, str]:
        return {"wandb": str(self.run.settings.sync_dir)}


class MlflowTracker:
    PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch

    def __init__(self, run: RunInfo) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        root = os.path.abspath(run.run_dir)
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root}/mlflow.db"
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(run.project)
        local = None if "MLFLOW_TRACKING_URI" in os.environ else f"file://{root}/mlflow-artifacts"
        exp_id = experiment.experiment_id if experiment else self.client.create_experiment(run.project, local)
        self.run_id = self.client.create_run(exp_id, run_name=run.experiment).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(run.config).items()]
        for i in range(0, len(params), self.PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i:i + self.PARAMS_PER_CALL])

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars(metrics).items()])

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")

    def location(self) -> dict[str, str]:
        return {"mlflow": f"{self.uri} (run {self.run_id})"}


TRACKERS: dict[str, type] = {
    "console": ConsoleTracker,
    "jsonl": JsonlTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}
assert tuple(TRACKERS) == LOGGERS, f"rlsp.config.choices.LOGGERS {LOGGERS} != trackers {tuple(TRACKERS)}"


def check_trackers(names: list[str]) -> None:
    """Refuse unknown names and trackers whose library is missing, before any worker has the run's config."""
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"trainer.logger contains {unknown}; legal entries: {list(TRACKERS)}")
    missing = {pip for n in names for module, pip in REQUIRES.get(n, {}).items()
               if importlib.util.find_spec(module) is None}
    if missing:
        raise ValueError(f"trainer.logger={list(names)} needs packages that are not installed: "
                         f"pip install {' '.join(sorted(missing))}")


def build_trackers(names: list[str], run: RunInfo) -> dict[str, Tracker]:
    """One tracker per name; if one fails to start, those already started are closed first."""
    built: dict[str, Tracker] = {}
    try:
        for name in dict.fromkeys(names):
            built[name] = TRACKERS[name](run)
    except Exception:
        for tracker in built.values():
            tracker.close(ok=False)
        raise
    return built
