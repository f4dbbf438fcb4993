"""The exit code of a stopped run is the signal's, wherever the driver was when it came: 143 for SIGTERM,
130 for Ctrl-C. The driver spends most of a step waiting in `ray.get` / `ray.wait` for workers that are
inside a collective, and Ray's core worker turns the KeyboardInterrupt a signal handler raises there into a
plain one: `Terminated` was lost and a scheduler's SIGTERM ended the run with Ctrl-C's 130. Here the signal
is delivered while the main thread waits in each of Ray's calls, and the entry point's exit for the
exception that comes out is checked.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
from omegaconf import OmegaConf

from rlsp.controller import stopping
from rlsp.main import stopped_exit

pytestmark = pytest.mark.e2e


@ray.remote(num_cpus=0, max_concurrency=8)  # threaded: a test's call does not queue behind the one before
class _Busy:
    """Stands for a worker inside a step's collective: the driver waits for its answer."""

    def work(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


@pytest.fixture(scope="module")
def busy():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    actor = _Busy.remote()
    ray.get(actor.work.remote(0.0))  # the actor is up before any wait is timed
    try:
        yield actor
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        ray.kill(actor)
        if started:
            ray.shutdown()


WAITS = {"get": lambda ref: ray.get(ref), "wait": lambda ref: ray.wait([ref], num_returns=1)}


@pytest.mark.parametrize("wait", sorted(WAITS))
@pytest.mark.parametrize(("signum", "code", "line"), [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                                      (signal.SIGINT, 130, "interrupted")], ids=["TERM", "INT"])
def test_a_signal_while_the_driver_waits_in_ray_exits_with_its_code(busy, tmp_path, capsys, wait, signum, code,
                                                                    line):
    stopping.catch_sigterm()  # as rlsp.main installs it once Ray is up
    ref = busy.work.remote(30.0)  # far longer than the signal takes to arrive
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signum))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as info:
        WAITS[wait](ref)
    assert time.monotonic() - t0 < 25, "the signal did not interrupt the wait"
    cfg = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path)}})
    capsys.readouterr()
    exit_ = stopped_exit(cfg, info.value)
    assert exit_.code == code, (type(info.value).__name__, exit_.code)
    assert f"{line}; no checkpoint was written" in capsys.readouterr().err  # rlsp's lines go to the terminal
