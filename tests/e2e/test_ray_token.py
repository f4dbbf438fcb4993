"""The private local Ray a run starts keeps its authentication token off the disk (Ray would otherwise
write ~/.ray/auth_token with mode 0644, readable by every local user, and leave it there); it starts
without an API server process and its exit does not wait for the autoscaler monitor.

A driver with its own empty HOME starts the private Ray the way `rlsp.main` does, runs a task on a worker
(which must authenticate with the same token), and stops; HOME must still be free of `.ray`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = """
import os, ray
from omegaconf import OmegaConf
from rlsp.config.schema import RLSPConfig
from rlsp.main import _init_ray
assert _init_ray(OmegaConf.structured(RLSPConfig), 1)
assert len(os.environ["RAY_AUTH_TOKEN"]) == 64
print("task:", ray.get(ray.remote(lambda: 41 + 1).remote()))
ray.shutdown()
"""


def test_private_ray_writes_no_token_into_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env["HOME"] = str(home)
    proc = subprocess.run([sys.executable, "-c", DRIVER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "task: 42" in proc.stdout
    written = [os.path.join(d, f) for d, _, files in os.walk(home) for f in files]
    assert not (home / ".ray").exists(), f"Ray wrote into HOME: {written}"


MONITOR_DRIVER = """
import ray
from omegaconf import OmegaConf
from ray._private import ray_constants, worker
from rlsp.config.schema import RLSPConfig
from rlsp.main import _init_ray
from rlsp.trainer.stopping import stop_autoscaler_monitor
assert _init_ray(OmegaConf.structured(RLSPConfig), 1)
print("task:", ray.get(ray.remote(lambda: 41 + 1).remote()))
procs = worker._global_node.all_processes
print("api server:", ray_constants.PROCESS_TYPE_DASHBOARD in procs)
monitor = procs[ray_constants.PROCESS_TYPE_MONITOR][0].process
stop_autoscaler_monitor()
print("monitor:", monitor.poll(), "others alive:", all(i.process.poll() is None for t, infos in procs.items()
                                                       if t != ray_constants.PROCESS_TYPE_MONITOR for i in infos))
everything = [i.process for infos in procs.values() for i in infos]
ray.shutdown()
print("after shutdown alive:", sum(p.poll() is None for p in everything))
"""


def test_the_private_ray_starts_no_api_server_and_stops_its_monitor_first_without_a_report():
    """The private Ray starts without the API server process (`without_api_server`) and still runs tasks;
    `stop_autoscaler_monitor` (before `ray.shutdown()` in rlsp.main) SIGKILLs the monitor while the rest
    of Ray runs on, no "autoscaler failed" error reaches the driver, and the shutdown still ends every
    process Ray started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-c", MONITOR_DRIVER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "task: 42" in proc.stdout and "api server: False" in proc.stdout, proc.stdout
    assert "monitor: -9 others alive: True" in proc.stdout, proc.stdout
    assert "after shutdown alive: 0" in proc.stdout, proc.stdout
    assert "autoscaler" not in (proc.stdout + proc.stderr).lower(), proc.stderr[-3000:]
