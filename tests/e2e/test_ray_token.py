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
from rlsp.controller.ray_session import init_ray
assert init_ray(OmegaConf.structured(RLSPConfig), 1)
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
from rlsp.controller.ray_session import init_ray
from rlsp.controller.stopping import stop_autoscaler_monitor
assert init_ray(OmegaConf.structured(RLSPConfig), 1)
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


START_DRIVER = """
import psutil, ray
from omegaconf import OmegaConf
from ray._private import ray_constants, worker
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.controller.ray_session import RayStart
from rlsp.controller.worker_pools import PoolSettings
import sys
print("torch before the workers are up:", "torch" in sys.modules)

def config(**settings):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {"trainer.device": "cpu", "trainer.n_gpus_per_node": 2, **settings}.items():
        OmegaConf.update(cfg, key, val)
    return cfg, validate_config(cfg)

def worker_processes():
    raylet = worker._global_node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    return [p for p in psutil.Process(raylet).children(recursive=True) if p.cmdline()[:1] == ["ray::WorkerProcess"]]

# A refused check: Ray and the worker processes started beside it are stopped, nothing is left.
cfg, layout = config()
start = RayStart(cfg, layout)
print("ray on a thread:", start._thread.name, start._thread.is_alive())
start.wait()
ray.get([w.__ray_ready__.remote() for w in start._pools[0].workers])  # up, the worker stack imported
print("torch in the driver:", "torch" in sys.modules)
procs = worker_processes()
services = [i.process for infos in worker._global_node.all_processes.values() for i in infos]
print("workers:", len(procs))
start.stop()
start.stop()  # idempotent
print("stopped:", ray.is_initialized(), sum(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs),
      sum(p.poll() is None for p in services), "thread alive:", start._thread.is_alive())

# Ray could not start (a value the config stage refuses, set after it): `wait` raises the reason.
cfg, layout = config()
OmegaConf.update(cfg, "ray_kwargs.ray_init.num_cpus", 4)
failed = RayStart(cfg, layout)
try:
    failed.wait()
except RuntimeError as exc:
    print("refused:", exc)
failed.stop()

# A process already connected (a caller's Ray) keeps it. The pools go to the caller only with the
# settings they started with; taken with others (a device guessed wrong), they are stopped.
cfg, layout = config()
ray.init(num_cpus=2, include_dashboard=False)
for device in ("cuda", "cpu"):
    kept = RayStart(cfg, layout)
    kept.wait()
    pools = kept.take_pools(PoolSettings(device, PoolSettings.guess(cfg).env))
    print(device, "taken:", pools and [(p.group, len(p.workers)) for p in pools], "left:", kept.take_pools(kept._settings))
    kept.stop()
print("kept:", ray.is_initialized(), "bundles left:", ray.available_resources().get("CPU", 0.0))
pools[0].stop()
ray.shutdown()
"""


def test_ray_starts_on_a_thread_beside_the_checks_and_a_refusal_stops_it_with_its_pools():
    """`RayStart` (rlsp.main's start while the checks run): Ray comes up on a thread that outlives Ray's
    processes, then the worker processes, all without torch in the driver; `stop` after a refused check ends
    those processes and every Ray service, twice safely; a failed start raises its reason on the main
    thread; a caller's Ray is kept; pools started for another device than the run's are not handed over."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-c", START_DRIVER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "torch before the workers are up: False" in out and "torch in the driver: False" in out, out
    assert "ray on a thread: rlsp-ray-start True" in out, out
    assert "workers: 2" in out, out
    assert "stopped: False 0 0 thread alive: False" in out, out
    assert ("refused: ray_kwargs.ray_init.num_cpus=4 on a CPU run: CPU workers share this machine's cores equally "
            "(Ray needs all of them); leave it null") in out, out
    assert "cuda taken: None left: None" in out, out
    assert "cpu taken: [('policy', 2)] left: None" in out and "kept: True bundles left: 0.0" in out, out
