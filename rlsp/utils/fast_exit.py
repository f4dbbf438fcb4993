"""End a command-line process as soon as its work is done, without the interpreter's teardown.

When `main` returns, CPython runs the atexit handlers and then tears every module down object by
object. With torch, transformers and Ray loaded that teardown alone takes ~1.5 s on a 2-core machine
and does nothing a finished command needs: what libraries must flush or close on exit (logging, Ray,
trackers) they register as atexit handlers, and those still run here. `run_and_exit(fn)` calls `fn`,
runs the atexit handlers, flushes stdout/stderr and ends the process with the exit code `fn` gave
(via SystemExit, as `sys.exit` does; 0 when it returns). While a non-daemon thread still runs, the
interpreter would wait for it: then the exit is the normal one.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn


def exit_code(code: Any) -> int:
    """The process exit status for `SystemExit(code)`, as the interpreter maps it (a message: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _other_threads_running() -> bool:
    main = threading.main_thread()
    return any(t is not main and t.is_alive() and not t.daemon for t in threading.enumerate())


def run_and_exit(fn: Callable[[], Any]) -> NoReturn:
    """Run `fn` and end the process with its exit code, skipping the interpreter's teardown.
    Exceptions other than SystemExit propagate (the normal exit prints their traceback)."""
    try:
        fn()
        code = 0
    except SystemExit as exc:
        code = exit_code(exc.code)
    if _other_threads_running():
        sys.exit(code)
    atexit._run_exitfuncs()  # what `sys.exit` would run before the teardown
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to write there
            pass
    os._exit(code)
