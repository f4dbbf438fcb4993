"""Trackers (`trainer.logger`): each backend writes a short run through MetricsLogger, and the test
reads it back with that library's own reader — tensorboard's EventAccumulator, wandb's transaction
log reader (`wandb leet inspect --json`, offline, no network), MLflow's MlflowClient on the local store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlsp.config.validate import LOGGERS
from rlsp.run.metrics import MetricsLogger
from rlsp.run.trackers import TRACKERS, check_trackers

STEPS = [
    {"reward/mean": 0.25, "actor/pg_loss": -0.5, "timing/step_s": 1.5, "val/accuracy": 0.0},
    {"reward/mean": 0.5, "actor/pg_loss": -0.25, "timing/step_s": 1.25},
    {"reward/mean": 0.75, "actor/pg_loss": 0.125, "timing/step_s": 1.0, "val/accuracy": 0.5},
]
CONFIG = {"trainer": {"project_name": "rlsp-test", "total_training_steps": 3}, "data": {"train_batch_size": 4}}


def _write(run_dir, names: list[str], ok: bool = True, steps=STEPS, start: int = 1) -> MetricsLogger:
    logger = MetricsLogger(str(run_dir), names)
    logger.open("rlsp-test", "unit", CONFIG, start_step=start)
    for i, metrics in enumerate(steps):
        logger.log(start + i, metrics)
    logger.close(ok)
    return logger


def test_legal_names_match_the_adapters():
    assert tuple(TRACKERS) == LOGGERS == ("console", "jsonl", "tensorboard", "wandb", "mlflow")
    with pytest.raises(ValueError, match=r"'neptune'.*legal entries: \['console', 'jsonl', 'tensorboard'"):
        check_trackers(["console", "neptune"])


def test_missing_library_is_named_with_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match="pip install wandb"):
        MetricsLogger("unused", ["jsonl", "wandb"])


def test_console_prints_one_line_per_step(tmp_path, capsys):
    _write(tmp_path, ["console"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "[rlsp.metrics]" in x]
    assert len(lines) == 3, err
    assert "step 1 | reward=0.25 val_acc=0 pg_loss=-0.5" in lines[0] and "step_s=1.5" in lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_jsonl_round_trip_and_resume(tmp_path):
    first = _write(tmp_path, ["jsonl"])
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == first.history == [{"step": i + 1, **s} for i, s in enumerate(STEPS)]
    # Resume from a step-2 checkpoint: its records replace the file, then steps 3.. follow.
    resumed = MetricsLogger(str(tmp_path), ["jsonl"])
    resumed.restore(records[:2])
    resumed.open(start_step=3)
    resumed.log(3, {"reward/mean": 1.0})
    resumed.close()
    again = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [1, 2, 3] and again[2]["reward/mean"] == 1.0


def test_tensorboard_event_accumulator_reads_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = _write(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"reward/mean", "actor/pg_loss", "timing/step_s", "val/accuracy"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("val/accuracy")] == [(1, 0.0), (3, 0.5)]
    assert logger.history[-1]["reward/mean"] == 0.75
    # A resumed attempt from step 2 hides what the first one logged from step 2 on (purge_step).
    _write(tmp_path, ["tensorboard"], steps=[{"reward/mean": 0.875}, {"reward/mean": 1.0}], start=2)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.875), (3, 1.0)]


def _wandb_records(run_dir) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("ok", [True, False])
def test_wandb_offline_run_reads_back(tmp_path, monkeypatch, ok):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = _write(tmp_path, ["wandb"], ok=ok)
    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, list((tmp_path / "wandb").iterdir())
    records = _wandb_records(run_dirs[0])
    history = [r["history"] for r in records if r["type"] == "history"]
    assert [h["step"]["num"] for h in history] == [1, 2, 3]
    assert [h["item"]["reward/mean"] for h in history] == [0.25, 0.5, 0.75]
    assert "val/accuracy" not in history[1]["item"] and history[2]["item"]["val/accuracy"] == 0.5
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["project"] == "rlsp-test" and run["display_name"] == "unit"
    assert run["config"]["update"]["trainer"]["total_training_steps"] == 3
    exits = [r["exit"] for r in records if r["type"] == "exit"]
    assert exits and exits[-1].get("exit_code", 0) == (0 if ok else 1)
    assert logger.history[0]["step"] == 1


@pytest.mark.parametrize("ok", [True, False])
def test_mlflow_local_store_reads_back(tmp_path, monkeypatch, ok):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # nothing may land in the working directory (e.g. ./mlruns)
    logger = MetricsLogger(str(tmp_path), ["mlflow"])
    logger.open("rlsp-test", "unit", CONFIG)
    where = logger.locations()["mlflow"]
    for i, metrics in enumerate(STEPS):
        logger.log(i + 1, metrics)
    logger.close(ok)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert where.startswith(uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("rlsp-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "unit" and run.info.status == ("FINISHED" if ok else "FAILED")
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/accuracy")] == [1, 3]
    assert run.data.params["trainer.total_training_steps"] == "3"
    assert run.data.params["data.train_batch_size"] == "4"
    assert os.listdir(tmp_path / "cwd") == []


def test_all_backends_together(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = MetricsLogger(str(tmp_path), list(LOGGERS))
    logger.open("rlsp-test", "all", CONFIG)
    logger.log(1, STEPS[0])
    where = logger.locations()
    logger.close()
    assert set(where) == {"metrics", "tensorboard", "wandb", "mlflow"}
    assert where["metrics"] == str(tmp_path / "metrics.jsonl")
    assert where["tensorboard"] == str(tmp_path / "tensorboard")
    assert where["wandb"].startswith(str(tmp_path / "wandb" / "offline-run-"))


def test_reward_plot_drawn_on_a_thread(tmp_path, caplog):
    """The end-of-run plot (`plot_rewards_in_background`, waited for by `wait_plot`): the PNG of the logged
    rewards at 600 x 350 pixels, none without rewards, and a failed drawing is logged, not raised."""
    from matplotlib.image import imread

    logger = _write(tmp_path, ["jsonl"])
    path = logger.plot_rewards_in_background()
    assert path == str(tmp_path / "reward.png")
    logger.wait_plot()
    assert imread(path).shape[:2] == (350, 600)
    assert _write(tmp_path / "none", ["jsonl"], steps=[{"actor/pg_loss": 0.5}]).plot_rewards_in_background() is None
    (tmp_path / "gone").mkdir()
    broken = _write(tmp_path / "gone", ["jsonl"])
    broken.run_dir = str(tmp_path / "gone" / "metrics.jsonl")  # a file, not a directory: savefig fails
    with caplog.at_level("ERROR"):
        broken.plot_rewards_in_background()
        broken.wait_plot()
    assert "the reward plot was not written" in caplog.text
