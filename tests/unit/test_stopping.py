"""SIGTERM raises Terminated (a KeyboardInterrupt: everything that stops a run for Ctrl-C stops it for
SIGTERM too), and the entry point's exit code for it is 128 + 15. During the start-up checks a signal
takes effect once they are done (`signals_deferred`), the same signal twice at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlsp.trainer.stopping import SIGTERM_EXIT_CODE, Terminated, catch_sigterm, signals_deferred


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


@pytest.mark.parametrize(("signum", "raised"), [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)],
                         ids=["TERM", "INT"])
def test_a_signal_during_the_checks_stops_the_run_after_them(signum, raised):
    previous = signal.getsignal(signal.SIGTERM)
    try:
        catch_sigterm()
        done = []
        with pytest.raises(raised) as info:
            with signals_deferred():
                os.kill(os.getpid(), signum)
                time.sleep(0.05)  # the handler has run: nothing raised inside the block
                done.append("the rest of the block")
        assert done == ["the rest of the block"] and type(info.value) is raised
        # the handlers before the block are back
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        # asked twice: at once
        with pytest.raises(raised), signals_deferred():
            os.kill(os.getpid(), signum)
            time.sleep(0.05)
            os.kill(os.getpid(), signum)
            time.sleep(1)
            pytest.fail("the second signal did not stop the block")
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_no_signal_no_exception():
    with signals_deferred():
        value = 1
    assert value == 1 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
