"""A scheduler's stop: Slurm's `scancel` (and container runtimes) signal the job's whole process group,
not only `python -m rlsp.main`. The run is started in a session of its own, as a job step is, and the
signal goes to that group (`os.killpg`):

* SIGTERM after step 2's checkpoint: exit 143 within 15 s (on a quiet machine: tests/timing.py scales it),
  one line naming the last complete checkpoint, no process of the run left (the private Ray's GCS, raylet,
  agents, workers included);
  with trainer.save_on_preempt=true the step in flight is checkpointed first and that is the one named;
* SIGTERM (143) or SIGINT (130, Ctrl-C in a terminal) while Ray starts: its line, nothing left, also
  when Python dropped the exception of Ray's SIGTERM handler (raised in an at-fork hook: the run went on).

Before Ray was kept out of the group, Ray's processes died with the driver, which waited 60 s for a GCS
that was gone and exited 1 without naming a checkpoint (during start-up: exit 15, silently).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from test_faults import _assert_nothing_left, _cmdline, _marked, _steps, _wait_for
from timing import allowed

from rlsp.controller.stopping import Terminated, ray_start_signals
from rlsp.run.checkpoint import damaged_file

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One worker keeps start-up short; 200 steps: the run is always mid-way when the signal comes.
TINY = {"trainer.device": "cpu", "trainer.n_gpus_per_node": 1, "data.train_batch_size": 4,
        "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.optim.lr": 1e-3, "trainer.test_freq": 0, "trainer.total_training_steps": 200,
        "trainer.save_final_model": "false", "trainer.plot": "false"}


def _start(run_dir: str, settings: dict, marker: str) -> subprocess.Popen:
    args = {**TINY, **settings, "trainer.default_local_dir": run_dir,
            "trainer.cache_dir": os.path.join(os.path.dirname(run_dir), "cache")}
    cmd = [sys.executable, "-m", "rlsp.main", *(f"{k}={v}" for k, v in args.items())]
    # A process group (and session) of its own, as a Slurm job step or a container has.
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "RLSP_FAULT_TEST": marker}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _signal_group(proc: subprocess.Popen, signum: int) -> tuple[str, float]:
    """Signal the run's whole process group; its stderr and the seconds until it exited."""
    t0 = time.monotonic()
    os.killpg(proc.pid, signum)
    _, err = proc.communicate(timeout=120)  # > the 60 s a driver waited for a GCS killed with it
    return err, time.monotonic() - t0


def _saved(run_dir: str) -> int:
    pointer = os.path.join(run_dir, "latest_checkpointed_iteration.txt")
    return int(open(pointer).read()) if os.path.exists(pointer) else 0


@pytest.mark.parametrize("save_on_preempt", [False, True], ids=["stop", "save_on_preempt"])
def test_sigterm_to_the_process_group_ends_the_run_like_sigterm_to_the_driver(tmp_path, save_on_preempt):
    marker, run_dir = uuid.uuid4().hex, str(tmp_path / "run")
    # With save_on_preempt, checkpoints every 2 steps: the step in flight (3) is saved only for the stop.
    settings = ({"trainer.save_freq": 2, "trainer.save_on_preempt": "true"} if save_on_preempt
                else {"trainer.save_freq": 1})
    proc = _start(run_dir, settings, marker)
    try:
        _wait_for(lambda: _saved(run_dir) >= 2, 300, "step 2's checkpoint")
        err, elapsed = _signal_group(proc, signal.SIGTERM)
    finally:
        proc.kill()
    assert proc.returncode == 143, (proc.returncode, f"{elapsed:.1f}s", err[-3000:])
    # 0.5 s on a quiet machine; 15 s there, scaled by how much slower this one is now (a second busy core,
    # a slower CPU), never past 45 s: well below the 60 s a driver waited for a GCS killed with it.
    bound = allowed(elapsed, 15, cap_s=45)
    assert elapsed <= bound, f"took {elapsed:.1f}s to stop (bound here now: {bound:.0f}s)"
    saved = _saved(run_dir)
    assert f"terminated (SIGTERM); last complete checkpoint: {run_dir}/global_step_{saved} " in err, err[-3000:]
    assert "Traceback" not in err
    assert damaged_file(os.path.join(run_dir, f"global_step_{saved}")) is None
    if save_on_preempt:
        assert "SIGTERM: the step in flight finishes and is checkpointed" in err
        # the step in flight when the signal came (3, unless it came between step 2's save and its end)
        assert saved == _steps(run_dir) >= 2, (saved, _steps(run_dir))
    _assert_nothing_left(marker, grace=5.0)
    print(f"SIGTERM to the group (save_on_preempt={save_on_preempt}): exit 143 after {elapsed:.2f}s, "
          f"checkpoint of step {saved}")


@pytest.mark.parametrize(("signum", "code", "line"), [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                                      (signal.SIGINT, 130, "interrupted")], ids=["TERM", "INT"])
def test_a_group_signal_while_ray_starts_exits_with_its_line(tmp_path, signum, code, line):
    marker, run_dir = uuid.uuid4().hex, str(tmp_path / "run")
    proc = _start(run_dir, {}, marker)
    try:
        # The GCS is Ray's first process: ray.init is under way.
        _wait_for(lambda: any("gcs_server" in _cmdline(p) for p in _marked(marker)), 120, "Ray's GCS to start")
        err, elapsed = _signal_group(proc, signum)
    finally:
        proc.kill()
    assert proc.returncode == code, (proc.returncode, f"{elapsed:.1f}s", err[-3000:])
    assert f"{line}; no checkpoint was written" in err and "Traceback" not in err, err[-3000:]
    # The rest of Ray's start, then its stop: 8 s on a quiet machine, 16.8 s with a second busy core. 15 s
    # there, scaled by how much slower this machine is now, never past 45 s (below the 60 s GCS wait).
    bound = allowed(elapsed, 15, cap_s=45)
    assert elapsed <= bound, f"took {elapsed:.1f}s to stop (bound here now: {bound:.0f}s)"
    _assert_nothing_left(marker, grace=5.0)
    print(f"signal {signum} to the group while Ray starts: exit {code} after {elapsed:.2f}s")



class _Dropped:
    """Signals this process from `__del__`, where Python drops the handler's exception (it only prints
    it), as it does in the at-fork hook Ray's SIGTERM handler ran in."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)
        time.sleep(0.01)  # the handler runs here


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped exception
def test_a_signal_whose_exception_python_dropped_still_stops_ray_start():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(Terminated), ray_start_signals():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init installs
            _Dropped(signal.SIGTERM)  # collected at once
            reached = True  # the SystemExit went nowhere
        assert reached
        with pytest.raises(KeyboardInterrupt), ray_start_signals():
            _Dropped(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
