"""Process-wide logging: rlsp's own lines on the terminal, everything else in the run's log file.

`get_logger` gives rlsp loggers a rank prefix (driver and worker lines can be told apart) and a
handler that writes through tqdm, so a line never lands on a progress bar's line.

A run started from the command line wraps itself in `log_to_run_file(path)`: from then on whatever
is written to the process's stdout/stderr — third-party warnings, Ray and vLLM start-up output, the
worker output Ray forwards to the driver, C++ logs — goes to `path`, while rlsp's own lines (and the
progress bar, see `terminal()`) still reach the terminal and are copied to `path` as well.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import TextIO

from tqdm import tqdm

_FORMAT = "%(asctime)s %(levelname)s [%(name)s%(rank)s] %(message)s"
_DATEFMT = "%H:%M:%S"
RUN_LOG_NAME = "run.log"  # under trainer.default_local_dir
STARTED_AT = time.time()  # when rlsp was first imported in this process: a run's wall-clock start
# The terminal while `log_to_run_file` holds stdout/stderr; None: the current sys.stderr.
_terminal: TextIO | None = None
_LOGGED_ONCE: set[str] = set()  # keys already logged by `log_once` in this process


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = os.environ.get("RANK")
        record.rank = f" rank{rank}" if rank is not None else ""
        return True


class _TerminalHandler(logging.Handler):
    """Writes each record above any progress bar on the terminal (tqdm clears and redraws the bar)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=terminal())
        except Exception:  # a logging failure must never end a run
            self.handleError(record)


def terminal() -> TextIO:
    """Where rlsp's own output (log lines, progress bar, summary) goes."""
    return _terminal if _terminal is not None else sys.stderr


def _rlsp_root() -> logging.Logger:
    root = logging.getLogger("rlsp")
    if not root.handlers:
        handler = _TerminalHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATEFMT))
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        root.setLevel(os.environ.get("RLSP_LOG_LEVEL", "INFO"))
        root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    _rlsp_root()
    return logger


def log_once(logger: logging.Logger, key: str, msg: str, *args: object) -> None:
    """Log `msg` at INFO the first time `key` comes up in this process: what a setting does (or that it
    has no effect here) is said once per role at start-up, not on every call."""
    if key in _LOGGED_ONCE:
        return
    _LOGGED_ONCE.add(key)
    logger.info(msg, *args)


@contextlib.contextmanager
def log_to_run_file(path: str) -> Iterator[str]:
    """Send this process's stdout/stderr (file descriptors 1 and 2, so child processes and C
    libraries too) to `path`, appending; rlsp's lines go to the terminal and to `path`."""
    global _terminal
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    term = os.fdopen(os.dup(saved[2]), "w", buffering=1, errors="replace")
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(log_fd, f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n".encode())
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATEFMT))
    file_handler.addFilter(_RankFilter())
    _rlsp_root().addHandler(file_handler)
    for fd in (1, 2):
        os.dup2(log_fd, fd)
    os.close(log_fd)
    _terminal = term
    try:
        yield path
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        _terminal = None
        _rlsp_root().removeHandler(file_handler)
        file_handler.close()
        term.close()
