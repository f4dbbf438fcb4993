"""verl's `ray_kwargs.ray_init.runtime_env` in a run's private Ray: `env_vars` reach every worker process rlsp
starts (the training pools' `WorkerProcess` actors, their values winning over rlsp's defaults) and every other
Ray process of the job (scoring and reward processes: a plain task here); `py_executable` starts the worker
processes through the launcher it names (a script here, as `uv run ...` would be).

The driver starts Ray and the pools the way `rlsp.main` does (`RayStart`), then reads each worker's environment
inside its process (`__ray_call__`), before any worker gets the run's config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = """
import json, os, sys, ray
from omegaconf import OmegaConf
from rlsp.config.schema import RLSPConfig
from rlsp.config.layout_build import build_layout
from rlsp.controller.ray_session import RayStart
from rlsp.controller.worker_pools import PoolSettings

cfg = OmegaConf.structured(RLSPConfig)
cfg.trainer.device, cfg.trainer.n_gpus_per_node = "cpu", 2
for role in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref):
    role.fsdp_config.fsdp_size = -1  # no `auto` to resolve (it reads the model): the layout alone is needed
env = cfg.ray_kwargs.ray_init.runtime_env
env.env_vars = {"RLSP_E2E_VAR": "from-ray-kwargs", "VLLM_LOGGING_LEVEL": "WARNING"}
env.py_executable = sys.argv[1]
errors = []
layout = build_layout(cfg, errors)
assert not errors, errors
start = RayStart(cfg, layout)
try:
    start.wait()
    seen = []
    for pool in start.take_pools(PoolSettings.of(cfg)):
        read = lambda self: {k: os.environ.get(k) for k in ("RLSP_E2E_VAR", "VLLM_LOGGING_LEVEL", "RANK",
                                                            "RLSP_VIA_LAUNCHER")}
        seen += ray.get([w.__ray_call__.remote(read) for w in pool.workers])
        pool.stop()
    task = ray.get(ray.remote(lambda: [os.environ.get("RLSP_E2E_VAR"), os.environ.get("RLSP_VIA_LAUNCHER")]).remote())
    print("RESULT", json.dumps({"workers": seen, "task": task}))
finally:
    start.stop()
"""


def test_env_vars_and_launcher_reach_every_worker_process(tmp_path):
    launcher = tmp_path / "launcher.sh"  # stands for `uv run ...`: sets something, then runs the command given
    launcher.write_text('#!/bin/sh\nexport RLSP_VIA_LAUNCHER=yes\nexec "$@"\n')
    launcher.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RLSP_E2E_VAR", "RLSP_VIA"))}
    proc = subprocess.run([sys.executable, "-c", DRIVER, f"{launcher} {sys.executable}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert sorted(w["RANK"] for w in result["workers"]) == ["0", "1"], result
    for worker in result["workers"]:
        assert worker["RLSP_E2E_VAR"] == "from-ray-kwargs" and worker["VLLM_LOGGING_LEVEL"] == "WARNING", worker
        assert worker["RLSP_VIA_LAUNCHER"] == "yes", worker  # started through py_executable
    assert result["task"] == ["from-ray-kwargs", "yes"]
