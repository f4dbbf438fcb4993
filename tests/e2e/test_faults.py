"""Faults end a run quickly and cleanly, and a stopped run continues exactly.

* kill -9 of a worker: the driver exits non-zero within 60 s naming the worker and its rank, and no
  process the run started is left;
* Ctrl-C (SIGINT): exit code 130 within 10 s, one line naming the last complete checkpoint, nothing left
  (these bounds hold on a quiet machine: tests/timing.py scales them);
* kill -9 of the driver after a checkpoint, then the same command again: steps k+1..N have exactly the
  metrics of an uninterrupted run (rewards, losses, grad norms bit for bit);
* the same checkpoint resumed on another layout (2 workers with sp=2 -> 1 worker with sp=1): step k+1
  equals the uninterrupted run within fp32 reduction-order tolerance (derived in tests/tolerances.py);
* a reward function returning NaN stops the run naming the function and the row; unknown `+keys` are
  refused before Ray starts, data problems before any worker has the run's config (with nothing left).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from test_grpo_e2e import SMALL
from test_sequence_layouts_e2e import CLOSE, assert_same_step
from timing import allowed

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXACT_SKIP = ("timing/", "startup/", "throughput/", "sp/a2a_time_share", "perf/")


def _start(run_dir, *overrides: str, marker: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlsp.main", *(f"{k}={v}" for k, v in SMALL.items()), "trainer.test_freq=0",
           f"trainer.default_local_dir={run_dir}", f"trainer.cache_dir={os.path.dirname(run_dir)}/../cache", *overrides]
    env = {**os.environ, "RLSP_FAULT_TEST": marker}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _marked(marker: str) -> list[int]:
    """PIDs of processes carrying the test's marker in their environment (the run and all it started)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RLSP_FAULT_TEST={marker}".encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def _steps(run_dir) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def _metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]


def _assert_nothing_left(marker: str, grace: float = 15.0) -> None:
    """No process of the run (driver, Ray's processes, workers: all carry the marker) outlives it by
    more than `grace` seconds; stragglers are killed and named."""
    try:
        _wait_for(lambda: not _marked(marker), grace, "the run's processes to end")
    except TimeoutError:
        left = {p: _cmdline(p) for p in _marked(marker)}
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"processes left behind: {left}") from None


def _kill_all(marker: str) -> None:
    for pid in _marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_killed_worker_ends_the_run_quickly_and_cleanly(tmp_path):
    marker = uuid.uuid4().hex
    proc = _start(str(tmp_path / "run"), "trainer.total_training_steps=200", marker=marker)
    try:
        _wait_for(lambda: _steps(tmp_path / "run") >= 2, 300, "two training steps")
        workers = [p for p in _marked(marker) if _cmdline(p).startswith("ray::WorkerProcess")]  # the policy workers
        assert workers, {p: _cmdline(p) for p in _marked(marker)}
        os.kill(workers[-1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=600)  # only ends a hung test (a driver waiting on its dead worker)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode not in (0, None)
    # 60 s on a quiet machine (a dead worker is seen within seconds), scaled by how much slower this one is now
    bound = allowed(elapsed, 60)
    assert elapsed <= bound, f"took {elapsed:.1f}s to end (bound here now: {bound:.0f}s)"
    assert "worker rank" in err and "died" in err, err[-3000:]
    _assert_nothing_left(marker)


def test_sigint_exits_130_within_10s_naming_the_checkpoint(tmp_path):
    marker = uuid.uuid4().hex
    proc = _start(str(tmp_path / "run"), "trainer.total_training_steps=200", "trainer.save_freq=1", marker=marker)
    try:
        _wait_for(lambda: _steps(tmp_path / "run") >= 2, 300, "two training steps")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)  # only ends a hung test: `elapsed` is bounded below
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    # ~1 s on a quiet machine; 10 s there, scaled by how much slower this one is now (a busy core, a slower CPU)
    bound = allowed(elapsed, 10)
    assert elapsed <= bound, f"took {elapsed:.1f}s to stop (bound here now: {bound:.0f}s)"
    assert "interrupted; last complete checkpoint: " + str(tmp_path / "run" / "global_step_") in err
    assert "Traceback" not in err
    _assert_nothing_left(marker)
    pointer = int((tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text())
    assert (tmp_path / "run" / f"global_step_{pointer}" / "trainer_state.json").exists()


def test_kill_and_resume_match_an_uninterrupted_run(tmp_path):
    layout = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "trainer.total_training_steps=4",
              "trainer.save_freq=2")
    marker = uuid.uuid4().hex
    reference = _start(str(tmp_path / "ref"), *layout, marker=marker)
    assert reference.wait(timeout=600) == 0, reference.stderr.read()[-3000:]
    # The same run, killed (driver and everything it started) once step 2 is checkpointed, then re-run.
    killed = _start(str(tmp_path / "run"), *layout, marker=marker)
    try:
        _wait_for(lambda: (tmp_path / "run" / "latest_checkpointed_iteration.txt").exists(), 300, "a checkpoint")
        _kill_all(marker)
    finally:
        killed.kill()
        killed.wait()
    resumed = _start(str(tmp_path / "run"), *layout, marker=marker)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0 and "resumed from" in err, err[-3000:]
    ref, run = _metrics(tmp_path / "ref"), _metrics(tmp_path / "run")
    assert [r["step"] for r in run] == [1, 2, 3, 4]
    for a, b in zip(ref, run):
        for key in a:
            if not key.startswith(EXACT_SKIP):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
    # Another layout: 1 worker, sp=1, from the reference's step-2 checkpoint.
    other = tmp_path / "other"
    other.mkdir()
    shutil.copytree(tmp_path / "ref" / "global_step_2", other / "global_step_2")
    moved = _start(str(other), "trainer.total_training_steps=3", "trainer.n_gpus_per_node=1", marker=marker)
    _, err = moved.communicate(timeout=600)
    assert moved.returncode == 0, err[-3000:]
    step3 = _metrics(other)[2]
    assert step3["step"] == 3
    # one step from the same checkpoint in another layout: the first-step bounds of tests/tolerances.py
    assert_same_step(step3, ref[2], CLOSE, tmp_path / "ref")
    _assert_nothing_left(marker)


def test_nan_reward_and_bad_input_fail_clearly(tmp_path):
    score = tmp_path / "score.py"
    score.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    return float('nan')\n")
    marker = uuid.uuid4().hex
    proc = _start(str(tmp_path / "nan"), f"reward.custom_function_path={score}", "trainer.total_training_steps=2",
                  marker=marker)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode not in (0, None)
    assert "returned nan (a reward must be a finite number)" in err and "row index=" in err, err[-3000:]
    assert not (tmp_path / "nan" / "metrics.jsonl").read_text().strip()  # no step was recorded
    # Refused before any worker has the run's config: an unknown '+key' (before Ray starts), and an empty
    # training file (the data stage, while Ray and the worker processes start beside it: stopped again,
    # nothing left).
    import pandas as pd

    empty = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str)}).to_parquet(empty)
    for extra, needle in (("+actor_rollout_ref.actor.ppo_epoch=2", "nearest legal keys: actor_rollout_ref.actor.ppo_epochs"),
                          (f"data.train_files={empty}", "is empty (0 rows)")):
        t0 = time.monotonic()
        proc = _start(str(tmp_path / "bad"), extra, marker=marker)
        _, err = proc.communicate(timeout=300)  # only ends a hung test
        elapsed = time.monotonic() - t0
        assert proc.returncode == 2 and needle in err, err[-3000:]
        assert "started a private local Ray" not in err and "run dir: " not in err
        # refused within 60 s on a quiet machine, scaled by how much slower this one is now
        bound = allowed(elapsed, 60)
        assert elapsed <= bound, f"refused after {elapsed:.1f}s (bound here now: {bound:.0f}s)"
    _assert_nothing_left(marker)
