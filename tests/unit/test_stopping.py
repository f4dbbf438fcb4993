"""SIGTERM raises Terminated (a KeyboardInterrupt: everything that stops a run for Ctrl-C stops it for
SIGTERM too), and the entry point's exit code for it is 128 + 15."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlsp.trainer.stopping import SIGTERM_EXIT_CODE, Terminated, catch_sigterm


def test_sigterm_raises_terminated_in_the_main_thread():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        catch_sigterm()
        with pytest.raises(Terminated) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # not reached: the handler runs as soon as os.kill returns
        assert isinstance(info.value, KeyboardInterrupt)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert SIGTERM_EXIT_CODE == 143
