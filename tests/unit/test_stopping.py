"""SIGTERM raises Terminated (a KeyboardInterrupt: everything that stops a run for Ctrl-C stops it for
SIGTERM too), and the entry point's exit code for it is 128 + 15. During the start-up checks a signal
takes effect once they are done (`signals_deferred`), the same signal twice at once. The exit code follows
the signal that arrived, even when the exception that reached the entry point lost its type on the way."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlsp.controller import stopping
from rlsp.controller.stopping import (
    SIGTERM_EXIT_CODE,
    StopRequest,
    Terminated,
    catch_sigterm,
    signals_deferred,
    stop_exit_code,
)


@pytest.fixture(autouse=True)
def handlers_restored():
    """catch_sigterm sets SIGTERM's and SIGINT's handlers: each test leaves them as it found them."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


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


def test_an_armed_stop_request_takes_the_first_sigterm_and_the_second_stops_at_once():
    """trainer.save_on_preempt: before the loop arms the request SIGTERM stops at once; once armed the first
    one only sets `requested` (the loop checkpoints, then raises), the second raises."""
    stop = StopRequest()
    catch_sigterm(stop)
    with pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert not stop.requested
    stop.armed = True
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler has run without raising
    assert stop.requested
    with pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)


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
        assert signal.getsignal(signal.SIGINT) is stopping._on_sigint
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
    assert value == 1


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["TERM", "INT"])
def test_the_exit_code_follows_the_signal_not_the_exception_type(signum, code):
    """A handler's exception replaced by a plain KeyboardInterrupt (as Ray's core worker does inside ray.get)
    still exits with the signal's code."""
    catch_sigterm()
    with pytest.raises(KeyboardInterrupt):
        try:
            os.kill(os.getpid(), signum)
            time.sleep(1)
        except KeyboardInterrupt:
            raise KeyboardInterrupt() from None  # what comes out of ray.get
    assert stop_exit_code(KeyboardInterrupt()) == code
    assert stop_exit_code(Terminated()) == 143  # the loop's own stop after save_on_preempt's checkpoint
