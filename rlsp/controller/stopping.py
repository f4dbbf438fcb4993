"""How a run stops on a signal: SIGTERM (Slurm, Kubernetes, `kill`) ends it as cleanly as Ctrl-C.

`catch_sigterm(stop)` makes SIGTERM raise `Terminated`, a KeyboardInterrupt, so every place that
already stops a run for Ctrl-C (workers killed without waiting, Ray stopped, one line naming the last
complete checkpoint) does the same for it; the entry point exits with 143 (128 + SIGTERM).

With `trainer.save_on_preempt=true` the first SIGTERM after this run's first step only asks the loop
to stop (`StopRequest`, which the loop arms and reads): the step in flight finishes, is checkpointed, and
then `Terminated` is raised. A second SIGTERM stops at once. Ray's `ray.init` installs its own SIGTERM
handler (a bare `sys.exit(15)`), so call this again once Ray is up, and start Ray inside
`ray_start_signals()`, which stops the run for a SIGTERM or Ctrl-C that arrives while Ray starts. The
start-up checks run inside `signals_deferred()`: a signal then stops the run once their imports are done.

A scheduler's stop (Slurm's `scancel`, a container runtime that signals every process) reaches every
process of the job's process group, not only the driver. A private local Ray started inside
`ray_in_own_session()` runs its processes (GCS, raylet, log monitor; the raylet forks the workers) in
sessions of their own, so such a signal reaches the driver alone and the run stops as for
`kill <driver>`: the step in flight can be saved first, the workers are still there. Left in the
group, Ray died with the driver, which then waited 60 s for a GCS that was gone and exited 1 without
naming a checkpoint. The processes still die with the driver, even on SIGKILL: Ray starts each one
with PR_SET_PDEATHSIG (kernel fate-sharing), and the workers end when their raylet does; after
`ray.shutdown()`, `kill_ray_sessions()` ends what is left in those sessions. Ctrl-C in a terminal
(SIGINT to the foreground group) reaches the driver alone in the same way.

The exit code comes from the signal, not from the exception's type (`stop_exit_code`): Ray's core worker
checks for signals while the driver waits in `ray.get` / `ray.wait` (a step's results, the workers inside a
collective) and replaces whatever KeyboardInterrupt a handler raised there with a plain one, so a SIGTERM
that arrived during such a wait surfaced as Ctrl-C (exit 130). Every handler here records its signal before
it raises.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from rlsp.utils.logging import get_logger

log = get_logger("rlsp.trainer")
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
_ray_sessions: set[int] = set()  # the sessions `ray_in_own_session` started (their leaders' PIDs)
_stop_signals: list[int] = []  # the signals that stopped (or began to stop) this process, in arrival order


class Terminated(KeyboardInterrupt):
    """The run received SIGTERM."""


@dataclass
class StopRequest:
    """trainer.save_on_preempt's stop: once `armed` (the option on and this run's first step done), the first
    SIGTERM only sets `requested`; the loop checkpoints the step in flight, then raises `Terminated`."""

    armed: bool = False
    requested: bool = False


def _stop(signum: int) -> KeyboardInterrupt:
    """The exception that stops the run for `signum`, recorded first (see `stop_exit_code`)."""
    _stop_signals.append(signum)
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C: Python's KeyboardInterrupt, recorded."""
    raise _stop(signum)


def stop_exit_code(exc: KeyboardInterrupt) -> int:
    """128 + the signal that stopped the run: 143 for SIGTERM, 130 for Ctrl-C. The last signal a handler
    recorded decides; the exception's type only when none was (Python's own SIGINT handler, or `Terminated`
    raised by the loop after save_on_preempt's checkpoint). Ray may have replaced the exception on its way
    out of `ray.get` (module docstring)."""
    if isinstance(exc, Terminated) or (_stop_signals and _stop_signals[-1] == signal.SIGTERM):
        return SIGTERM_EXIT_CODE
    return 128 + signal.SIGINT


def catch_sigterm(stop: StopRequest | None = None) -> None:
    """SIGTERM raises `Terminated` in the main thread (or, the first time while `stop` is armed, only sets
    `stop.requested`); Ctrl-C raises KeyboardInterrupt as before, both recorded for `stop_exit_code`.
    No-op outside the main thread, where Python cannot set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if stop is not None and stop.armed and not stop.requested:
            stop.requested = True
            log.warning("SIGTERM: the step in flight finishes and is checkpointed, then the run stops "
                        "(SIGTERM again stops at once)")
            return
        raise _stop(signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_sigint):
        signal.signal(signal.SIGINT, _on_sigint)  # an ignored SIGINT (a background job) stays ignored


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGTERM and Ctrl-C (SIGINT) that arrive in this block stop the run at its end, as they would have
    inside it: `Terminated` or KeyboardInterrupt. Raised inside an import, their exception can leave a
    module half initialised (numpy then fails with another error, and the run exited 1 with it instead of
    143 or 130 with its line). The block is the start-up checks, which import torch and transformers
    (seconds). The same signal a second time raises at once."""
    if threading.current_thread() is not threading.main_thread():  # only there can handlers be set
        yield
        return
    caught: list[int] = []

    def defer(signum: int, frame: FrameType | None) -> None:
        if signum in caught:
            raise _stop(signum)
        caught.append(signum)

    previous = {signum: signal.signal(signum, defer) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if caught:
        raise _stop(caught[0])


@contextlib.contextmanager
def ray_start_signals() -> Iterator[None]:
    """A SIGTERM (or Ctrl-C) while Ray starts stops the run like one at any other time: `Terminated`
    (exit 143 with its line) or KeyboardInterrupt. Ray's own SIGTERM handler ends the process with
    `sys.exit(15)`, and Python drops an exception raised where it cannot propagate (in an at-fork hook
    while Ray spawns a process): the run went on. So the signals that arrive in this block are also
    read from Python's wakeup fd (each one a handler caught), and raised at its end if nothing did."""
    if threading.current_thread() is not threading.main_thread():  # only there can the fd be set
        yield
        return
    read_fd, write_fd = os.pipe()
    for fd in (read_fd, write_fd):
        os.set_blocking(fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    try:
        yield
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        raise _stop(signal.SIGTERM) from None
    finally:
        signal.set_wakeup_fd(previous)
        caught = _read_all(read_fd)
        os.close(read_fd)
        os.close(write_fd)
    if signal.SIGTERM in caught:
        raise _stop(signal.SIGTERM)
    if signal.SIGINT in caught:
        raise _stop(signal.SIGINT)


def _read_all(fd: int) -> bytes:
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def ray_in_own_session() -> Iterator[None]:
    """Ray processes started in this block (by `ray.init(address="local")`) run in a new session, out of
    the driver's process group (see the module docstring). Ray does the same on Windows, with a new
    process group, wherever kernel fate-sharing makes the group unnecessary for cleaning up; without
    fate-sharing Ray relies on the group (its reaper kills it), so nothing changes there."""
    import ray
    from ray._private import services, utils

    popen = getattr(services, "ConsolePopen", None)
    if popen is None or not utils.detect_fate_sharing_support():
        log.warning("Ray's processes stay in this run's process group (ray %s: %s), so a signal to the whole "
                    "group (Slurm's scancel) stops them with the driver", ray.__version__,
                    "no kernel fate-sharing" if popen else "no ray._private.services.ConsolePopen")
        yield
        return

    class SessionPopen(popen):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "start_new_session": True})
            _ray_sessions.add(self.pid)

    services.ConsolePopen = SessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = popen


def stop_autoscaler_monitor() -> None:
    """SIGKILL the autoscaler monitor of the private Ray this process started, just before `ray.shutdown()`.
    Ray stops its processes one by one, the GCS before the monitor; on SIGTERM the monitor reports its own
    end to that GCS, which is gone by then, so it is killed only after Ray's 1 s grace: every run's exit
    waited for it. A single-node private Ray has nothing to scale, and on SIGKILL nothing is reported
    (SIGTERM while the GCS is up would publish "the autoscaler failed" to the driver). Does nothing for a
    joined cluster: this process started no monitor there."""
    try:
        from ray._private import ray_constants, worker

        node = worker._global_node
        monitors = node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []) if node is not None else []
        for info in monitors:
            if info.process.poll() is None:
                info.process.kill()
                info.process.wait()
    except (ImportError, AttributeError, OSError) as exc:  # another Ray's internals: its own shutdown still runs
        log.warning("could not stop Ray's autoscaler monitor before the shutdown (%s: %s); the exit may wait ~1 s "
                    "for it", type(exc).__name__, exc)


def kill_ray_sessions() -> None:
    """SIGKILL what is left in the sessions `ray_in_own_session` started, once `ray.shutdown()` is done:
    a run stopped while Ray starts leaves the raylet's agents behind, which watch their raylet only once
    up and wait 60 s for a GCS that is gone. (Linux never reuses a PID that is still a session's ID.)"""
    if not _ray_sessions:  # no private Ray was started here
        return
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        try:
            if os.getsid(pid) in _ray_sessions:
                os.kill(pid, signal.SIGKILL)
        except OSError:  # gone meanwhile
            continue
