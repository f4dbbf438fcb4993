"""How a run stops on a signal: SIGTERM (Slurm, Kubernetes, `kill`) ends it as cleanly as Ctrl-C.

`catch_sigterm(trainer)` makes SIGTERM raise `Terminated`, a KeyboardInterrupt, so every place that
already stops a run for Ctrl-C (workers killed without waiting, Ray stopped, one line naming the last
complete checkpoint) does the same for it; the entry point exits with 143 (128 + SIGTERM).

With `trainer.save_on_preempt=true` the first SIGTERM after this run's first step only asks the loop
to stop: the step in flight finishes, is checkpointed, and then `Terminated` is raised. A second
SIGTERM stops at once. Ray's `ray.init` installs its own SIGTERM handler (a bare `sys.exit(15)`), so
call this again once Ray is up.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from rlsp.utils.logging import get_logger

log = get_logger("rlsp.trainer")
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """The run received SIGTERM."""


def catch_sigterm(trainer: Any | None = None) -> None:
    """SIGTERM raises `Terminated` in the main thread (or, with the trainer's save_on_preempt, first
    sets `trainer.stop_requested`). No-op outside the main thread, where Python cannot set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        save_first = (trainer is not None and trainer.cfg.trainer.save_on_preempt
                      and trainer.first_step_done_at is not None)
        if save_first and not trainer.stop_requested:
            trainer.stop_requested = True
            log.warning("SIGTERM: the step in flight finishes and is checkpointed, then the run stops "
                        "(SIGTERM again stops at once)")
            return
        raise Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)
