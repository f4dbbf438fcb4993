"""The modules the GPU checks run (scripts/gpu_check.sh) import on a machine without hydra, ray and vLLM.

The GPU machine rlsp is checked on has torch, transformers and peft only; a top-level `import hydra` anywhere under
the engine, the models or rlsp.config would end every check there with ImportError. A fresh interpreter blocks the
three packages and imports what the checks use.
"""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('hydra', 'ray', 'vllm'):
            raise ImportError('blocked on the GPU machine: ' + name)
sys.meta_path.insert(0, Block())
import rlsp.config.verl_keys, rlsp.engine.fsdp_engine, rlsp.engine.router_replay, rlsp.models.loading
import rlsp.workers.roles.actor, rlsp.rollout.hf_engine
print('imported')
"""


def test_gpu_check_modules_import_without_hydra_ray_vllm():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr[-2000:]
