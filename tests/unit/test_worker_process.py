"""The worker processes' actor class (rlsp.controller.worker_process): its module and the pool start
(rlsp.controller.worker_pools) import neither torch nor transformers, so the driver starts the processes
while it still imports both; every public method of `RayWorker` is forwarded under its name."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

from omegaconf import OmegaConf

from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.controller.worker_group import RayWorker
from rlsp.controller.worker_process import WORKER_METHODS, WorkerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_public_method_of_the_worker_is_forwarded():
    public = {name for name, _ in inspect.getmembers(RayWorker, inspect.isfunction) if not name.startswith("_")}
    assert set(WORKER_METHODS) == public
    assert all(getattr(WorkerProcess, name).__name__ == name for name in WORKER_METHODS)


def test_forwarded_calls_reach_the_worker_with_their_arguments_and_results():
    cfg = OmegaConf.structured(RLSPConfig)
    OmegaConf.update(cfg, "trainer.device", "cpu")
    process = WorkerProcess(validate_config(cfg), "policy", 0)
    assert process.worker.cfg is None  # the config comes later, with init_worker (or configure)
    assert process.configure(OmegaConf.to_container(cfg)) is None
    assert process.worker.cfg.trainer.device == "cpu"
    host, port = process.rendezvous_address()  # rank 0 of one node: the store's socket, on loopback
    assert host == "127.0.0.1" and port == process.worker._store_socket.getsockname()[1]
    process.worker._store_socket.close()


def test_starting_worker_processes_imports_neither_torch_nor_transformers():
    code = ("import sys, rlsp.controller.worker_process, rlsp.controller.worker_pools, rlsp.controller.ray_session; "
            "print(sorted(m for m in ('torch', 'transformers', 'tensordict') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_pools_device_read_without_torch_is_torchs_answer_here():
    """`trainer.device=auto`: the worker processes start with the device nvidia-smi shows (no torch in the
    driver yet); here it equals torch's answer, so `RayStart.take_pools` hands them over unchanged."""
    from rlsp.controller.worker_pools import PoolSettings

    cfg = OmegaConf.structured(RLSPConfig)
    assert cfg.trainer.device == "auto"
    assert PoolSettings.guess(cfg) == PoolSettings.of(cfg)
    for device in ("cpu", "cuda"):
        OmegaConf.update(cfg, "trainer.device", device)
        assert PoolSettings.guess(cfg).device_type == device  # an explicit device is taken as it is
