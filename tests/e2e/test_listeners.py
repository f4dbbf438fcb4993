"""A local run opens no listener beyond loopback.

The default run (private Ray, two workers over gloo) with in-process vLLM rollouts (the engine that opens
sockets of its own; the tiny model's default is HF generate) is watched from the outside
while it runs: every TCP socket in the LISTEN state owned by a process the run started (driver, Ray's
services, the workers) must be bound to 127.0.0.1 or ::1 — not to 0.0.0.0/:: (every interface) nor
to an external address. The workers' process-group store used to listen on every interface.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
import uuid

import pytest
from test_faults import _cmdline, _marked

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _address(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} ('0100007F:1F90') as text ('127.0.0.1')."""
    raw = bytes.fromhex(hex_addr.split(":")[0])
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def _listeners(pids: list[int]) -> set[tuple[str, int, str]]:
    """(address, port, process) of every listening TCP socket held by `pids`."""
    owner = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    owner[link[8:-1]] = pid
        except OSError:  # the process ended or closed the fd meanwhile
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in owner:  # 0A: LISTEN
                pid = owner[cols[9]]
                found.add((_address(cols[1]), int(cols[1].split(":")[1], 16), _cmdline(pid)[:60]))
    return found


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def test_local_run_listens_on_loopback_only(tmp_path):
    marker = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "rlsp.main", "actor_rollout_ref.rollout.name=vllm", "trainer.total_training_steps=1",
           "trainer.test_freq=0",
           "trainer.save_final_model=false", "trainer.plot=false", f"trainer.default_local_dir={tmp_path / 'run'}",
           f"trainer.cache_dir={tmp_path / 'cache'}"]
    seen: set[tuple[str, int, str]] = set()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "RLSP_FAULT_TEST": marker},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            seen.update(_listeners(_marked(marker)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=600)  # only ends a hung test: a 1-step run, however slow the machine
    finally:
        proc.kill()
        done.set()
        watcher.join()
    assert proc.returncode == 0, err[-4000:]
    assert "run complete: 1 step" in err, err[-3000:]
    workers = [s for s in seen if "Worker" in s[2]]
    assert workers, f"no listener of a worker was seen: {sorted(seen)}"
    wide = sorted(s for s in seen if not _is_loopback(s[0]))
    assert not wide, f"listeners beyond loopback: {wide}"
