"""Load a user reward function from a Python file (`reward.custom_function_path` / `_name`).

The file is imported as a fresh module under a private, path-derived name, so it may live anywhere
and need not be on `sys.path`; the named attribute must be a callable with the reward signature
`fn(data_source, solution_str, ground_truth, extra_info=None) -> float`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable


def load_custom_reward_fn(path: str, name: str = "compute_score") -> Callable[..., float]:
    """Import `path` and return its callable `name`.

    Raises ValueError when the file is missing or not a .py file, when it has no attribute `name`
    (listing the callables it does have) or when that attribute is not callable; RuntimeError when
    importing the file itself fails.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ValueError(f"custom reward file not found: {path} (reward.custom_function_path)")
    if not path.endswith(".py"):
        raise ValueError(f"custom reward file must be a .py file, got {path}")
    # A path-derived module name keeps two reward files with the same basename apart.
    module_name = "rlsp_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets dataclasses/pickling inside the file resolve the module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise RuntimeError(f"importing custom reward file {path} failed: {exc!r}") from exc
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(
            f"custom reward file {path} has no attribute {name!r} (reward.custom_function_name); "
            f"callables found: {public}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"{name!r} in {path} is a {type(fn).__name__}, not a callable")
    return fn
