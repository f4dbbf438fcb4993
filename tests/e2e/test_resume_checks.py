"""A rerun resumes only what its command describes, and SIGTERM ends a run as cleanly as Ctrl-C.

On one finished 2-step run (tiny model, checkpoints at steps 1 and 2):
* the same command again: "the run is already complete" and exit 0 within seconds, Ray never started;
* another model (6 q / 2 kv heads instead of 4 / 2) or an algorithm that adds the critic: refused with
  both models described, exit 2, before any worker has the run's config (the private Ray and the worker
  processes that came up beside the checks stopped again, nothing left), the run dir untouched;
* a copy with a truncated actor shard in its newest checkpoint, rerun with another learning rate and
  one more step: the file is named, the previous checkpoint is used, the changed setting is listed,
  the run continues; resume_path to the damaged checkpoint is refused naming the file.
On runs of their own: SIGTERM after 2 steps exits 143 within 10 s (on a quiet machine: tests/timing.py
scales the bounds) with one line naming the last complete checkpoint and no process left; with
trainer.save_on_preempt the step in flight is checkpointed first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from test_faults import _assert_nothing_left, _metrics, _steps, _wait_for
from test_grpo_e2e import SMALL
from timing import allowed

from rlsp.models.tiny import TinyModelSpec, ensure_tiny_model
from rlsp.run.checkpoint import damaged_file

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FINISHED = ("trainer.total_training_steps=2", "trainer.save_freq=1")
# rlsp's own lines (the terminal's): the private Ray is up (logged only once every check passed, while Ray
# and the worker processes may start beside the checks), and the run goes on to its workers.
RAY_STARTED = "started a private local Ray"
WORKERS_NEXT = "run dir: "


def _start(run_dir, cache, *overrides: str, marker: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlsp.main", *(f"{k}={v}" for k, v in SMALL.items()), "trainer.test_freq=0",
           f"trainer.default_local_dir={run_dir}", f"trainer.cache_dir={cache}", *overrides]
    env = {**os.environ, "RLSP_FAULT_TEST": marker}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(run_dir, cache, *overrides: str, timeout: float = 300) -> tuple[int, str, float]:
    """`timeout` only ends a hung test (a refusal took 27 s on a 2-core machine with its cores shared)."""
    marker = uuid.uuid4().hex
    t0 = time.monotonic()
    proc = _start(run_dir, cache, *overrides, marker=marker)
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    elapsed = time.monotonic() - t0
    _assert_nothing_left(marker)
    return proc.returncode, err, elapsed


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """(run dir, cache dir) of a finished 2-step run with checkpoints at steps 1 and 2."""
    base = tmp_path_factory.mktemp("resume")
    run_dir, cache = str(base / "run"), str(tmp_path_factory.getbasetemp() / "cache")
    rc, err, _ = _run(run_dir, cache, *FINISHED)
    assert rc == 0 and os.path.isdir(os.path.join(run_dir, "global_step_1")), err[-3000:]
    return run_dir, cache


def test_a_finished_run_says_so_before_ray_starts(finished):
    run_dir, cache = finished
    rc, err, elapsed = _run(run_dir, cache, *FINISHED, timeout=60)
    assert rc == 0, err[-3000:]
    assert "the run is already complete at step 2 (trainer.total_training_steps=2)" in err
    assert RAY_STARTED not in err and WORKERS_NEXT not in err and "differ from its config.yaml" not in err
    # ~1 s on a quiet machine: nothing heavy is imported. 15 s there, scaled by how much slower this one is now.
    bound = allowed(elapsed, 15)
    assert elapsed <= bound, f"took {elapsed:.1f}s (bound here now: {bound:.0f}s)"
    print(f"already-complete answer: {elapsed:.2f}s")


def test_another_model_or_a_critic_is_refused_before_workers_start(finished, tmp_path):
    run_dir, cache = finished
    spec = TinyModelSpec(hidden_size=192, num_attention_heads=6, num_key_value_heads=2)
    other = ensure_tiny_model(str(tmp_path / "tiny-6q2kv"), spec)
    config = os.path.join(run_dir, "config.yaml")
    before = os.path.getmtime(config)
    rc, err, elapsed = _run(run_dir, cache, f"actor_rollout_ref.model.path={other}", "trainer.total_training_steps=4")
    assert rc == 2, err[-3000:]
    assert (f"cannot resume: run dir trainer.default_local_dir={run_dir!r} holds checkpoint global_step_2, which "
            "this command cannot load") in err
    assert "(qwen2: 2 layers, 4 attention / 2 kv heads of 32, hidden 128" in err
    assert f"this command trains actor_rollout_ref.model.path={other} (qwen2: 2 layers, 6 attention / 2 kv heads" in err
    assert "hidden_size 128 -> 192, num_attention_heads 4 -> 6" in err and "new trainer.default_local_dir" in err
    assert RAY_STARTED not in err and WORKERS_NEXT not in err and "Traceback" not in err
    rc, err, _ = _run(run_dir, cache, "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2",
                      "trainer.total_training_steps=4")
    assert rc == 2, err[-3000:]
    assert ("its run had no critic (algorithm.adv_estimator='grpo'); this command has one "
            "(algorithm.adv_estimator='gae')") in err
    assert RAY_STARTED not in err and WORKERS_NEXT not in err
    assert os.path.getmtime(config) == before  # nothing in the run dir was rewritten
    print(f"refusal: {elapsed:.2f}s")


def test_a_truncated_shard_is_named_and_changed_settings_are_listed(finished, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(finished[0], run_dir)
    newest = os.path.join(run_dir, "global_step_2")
    shard = os.path.join(newest, "actor", sorted(f for f in os.listdir(os.path.join(newest, "actor"))
                                                 if f.endswith(".distcp"))[-1])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    rc, err, _ = _run(str(tmp_path / "elsewhere"), finished[1], "trainer.resume_mode=resume_path",
                      f"trainer.resume_from_path={newest}")
    assert rc == 2 and f"trainer.resume_from_path={newest!r} cannot be resumed: {shard} is truncated" in err, err[-3000:]
    rc, err, _ = _run(run_dir, finished[1], "trainer.total_training_steps=3", "trainer.save_freq=1",
                      "actor_rollout_ref.actor.optim.lr=0.0005")
    assert rc == 0, err[-3000:]
    assert f"checkpoint {newest} cannot be resumed: {shard} is truncated" in err
    assert f"resuming from {run_dir}/global_step_1, the newest whole checkpoint" in err
    listed = err.split("differ from its config.yaml")[1].split(" INFO ")[0]
    assert "actor_rollout_ref.actor.optim.lr: 0.001 -> 0.0005" in listed
    assert "total_training_steps" not in listed and "default_local_dir" not in listed
    assert f"resumed from {run_dir}/global_step_1 at step 1" in err
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3]
    assert damaged_file(newest) is None  # step 2 was trained and saved again


def _sigterm_after_two_steps(run_dir, cache, *overrides: str) -> tuple[int, str, float]:
    marker = uuid.uuid4().hex
    proc = _start(run_dir, cache, "trainer.total_training_steps=200", *overrides, marker=marker)
    try:
        _wait_for(lambda: _steps(run_dir) >= 2, 240, "two training steps")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)  # only ends a hung test: the tests bound `elapsed`
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    _assert_nothing_left(marker)
    return proc.returncode, err, elapsed


def test_sigterm_ends_the_run_like_ctrl_c(tmp_path):
    run_dir = str(tmp_path / "run")
    rc, err, elapsed = _sigterm_after_two_steps(run_dir, str(tmp_path.parent / "cache"), "trainer.save_freq=1")
    assert rc == 143, err[-3000:]
    # ~1 s on a quiet machine; 10 s there, scaled by how much slower this one is now (a busy core, a slower CPU)
    bound = allowed(elapsed, 10)
    assert elapsed <= bound, f"took {elapsed:.1f}s to stop (bound here now: {bound:.0f}s)"
    assert f"terminated (SIGTERM); last complete checkpoint: {run_dir}/global_step_" in err
    assert "(continue with the same command)" in err and "Traceback" not in err
    pointer = int(open(os.path.join(run_dir, "latest_checkpointed_iteration.txt")).read())
    assert damaged_file(os.path.join(run_dir, f"global_step_{pointer}")) is None
    print(f"SIGTERM: exit {rc} after {elapsed:.2f}s")


def test_save_on_preempt_checkpoints_the_step_in_flight(tmp_path):
    run_dir = str(tmp_path / "run")
    rc, err, elapsed = _sigterm_after_two_steps(run_dir, str(tmp_path.parent / "cache"), "trainer.save_freq=-1",
                                                "trainer.save_on_preempt=true")
    assert rc == 143, err[-3000:]
    last = _steps(run_dir)
    assert "SIGTERM: the step in flight finishes and is checkpointed" in err
    assert f"terminated (SIGTERM); last complete checkpoint: {run_dir}/global_step_{last} " in err
    assert sorted(d for d in os.listdir(run_dir) if d.startswith("global_step_")) == [f"global_step_{last}"]
    assert damaged_file(os.path.join(run_dir, f"global_step_{last}")) is None
    # the step in flight, its checkpoint, the stop: 30 s on a quiet machine, scaled by how much slower this one is
    bound = allowed(elapsed, 30)
    assert elapsed <= bound, f"took {elapsed:.1f}s to stop (bound here now: {bound:.0f}s)"
    print(f"SIGTERM with save_on_preempt: exit {rc} after {elapsed:.2f}s, checkpoint of step {last}")
