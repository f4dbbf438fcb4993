"""`run_and_exit`: the exit code of SystemExit, the atexit handlers run, stdout flushed; a running
non-daemon thread gets the interpreter's normal exit (it waits for the thread)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROGRAM = """
import atexit, sys, threading, time
from rlsp.utils.fast_exit import run_and_exit
atexit.register(lambda: open({marker!r}, "w").write("closed"))
def fn():
    print("buffered output", end="")  # no newline: still in the buffer when the process ends
    {body}
run_and_exit(fn)
print("not reached")
"""


@pytest.mark.parametrize("body,code", [("pass", 0), ("sys.exit(3)", 3), ("sys.exit(None)", 0),
                                       ("sys.exit('refused: bad value')", 1), ("raise KeyboardInterrupt", None)])
def test_exit_code_atexit_and_flushed_output(tmp_path, body, code):
    marker = tmp_path / "marker"
    proc = subprocess.run([sys.executable, "-c", PROGRAM.format(marker=str(marker), body=body)],
                          capture_output=True, text=True, timeout=120)
    if code is None:  # not a SystemExit: propagates to the interpreter, which reports it
        assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    else:
        assert proc.returncode == code, proc.stderr
        assert "not reached" not in proc.stdout
    assert proc.stdout.startswith("buffered output")
    assert marker.read_text() == "closed"
    if body.startswith("sys.exit('"):
        assert "refused: bad value" in proc.stderr


def test_a_running_thread_is_waited_for(tmp_path):
    marker = tmp_path / "marker"
    body = ("t = threading.Thread(target=lambda: (time.sleep(0.5), open({m!r}, 'w').write('thread done')))\n"
            "    t.start()\n    sys.exit(4)").format(m=str(tmp_path / "thread"))
    proc = subprocess.run([sys.executable, "-c", PROGRAM.format(marker=str(marker), body=body)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert (tmp_path / "thread").read_text() == "thread done" and marker.read_text() == "closed"
