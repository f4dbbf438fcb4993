"""What a person sees: rlsp's own lines on the terminal (never on a progress bar's line), everything
else written to stdout/stderr in the run's log file, and a closing summary with the numbers."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

from tqdm import tqdm

from rlsp.trainer.progress import format_summary
from rlsp.utils.logging import get_logger

SNIPPET = textwrap.dedent("""
    import os, subprocess, sys, warnings
    from rlsp.utils.logging import get_logger, log_to_run_file
    log = get_logger("rlsp.test")
    with log_to_run_file(sys.argv[1]):
        log.info("own line")
        print("library print on stdout")
        sys.stderr.write("library text on stderr\\n")
        os.write(2, b"C-level write to fd 2\\n")
        warnings.warn("a third-party warning")
        subprocess.run([sys.executable, "-c", "print('child process output')"], check=True)
    log.info("after the run")
    print("stdout restored")
""")
NOISE = ("library print", "library text", "C-level", "third-party warning", "child process")


def test_run_file_takes_everything_but_rlsp_lines(tmp_path):
    path = tmp_path / "run" / "run.log"
    proc = subprocess.run([sys.executable, "-c", SNIPPET, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    terminal = proc.stdout + proc.stderr
    assert "own line" in proc.stderr and "after the run" in proc.stderr and "stdout restored" in proc.stdout
    assert not [n for n in NOISE if n in terminal], terminal
    logged = path.read_text()
    assert all(n in logged for n in NOISE), logged
    assert "INFO [rlsp.test] own line" in logged and "after the run" not in logged


def test_log_lines_never_share_the_progress_bar_line(capsys):
    log = get_logger("rlsp.test")
    bar = tqdm(total=3, desc="rlsp", file=sys.stderr, disable=False, ncols=80)
    for step in range(1, 4):
        bar.update(1)
        log.info("step %d | reward=0.5", step)
    bar.close()
    err = capsys.readouterr().err
    shown = [line.split("\r")[-1] for line in err.split("\n") if "reward=0.5" in line]
    assert len(shown) == 3, err
    assert all(re.match(r"\d\d:\d\d:\d\d INFO \[rlsp.test\] step \d \| reward=0.5$", s) for s in shown), shown


def test_summary_has_the_numbers_and_the_outputs():
    history = [{"step": 1, "reward/mean": 0.03, "val/accuracy": 0.0, "timing/step_s": 2.0},
               {"step": 2, "reward/mean": 0.01, "timing/step_s": 1.0},
               {"step": 3, "reward/mean": 0.5, "val/accuracy": 0.25, "timing/step_s": 1.5}]
    text = format_summary(history, 2, 3, 4.0, 75.0, "/runs/a",
                          {"checkpoint": "/runs/a/global_step_3", "mlflow": "sqlite:////runs/a/mlflow.db (run x)"})
    lines = text.splitlines()
    assert lines[0] == "run complete: 2 steps in 4.0s (steps 2-3 of 3; 1.25 s/step); wall time 1m15s with start-up"
    assert "reward/mean   0.030 (step 1) -> 0.500 (step 3)" in text
    assert "val/accuracy  0.000 (step 1) -> 0.250 (step 3)" in text
    assert "outputs       /runs/a" in text and "checkpoint    global_step_3" in text
    assert "mlflow        sqlite:////runs/a/mlflow.db (run x)" in text
