"""The scripts of benchmarks/ as modules (they are scripts, not a package), for the tests that call their functions.

Each script is executed once per test process (cached), however many tests use it.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def load_benchmark(name: str) -> ModuleType:
    """benchmarks/`name`.py, executed as a module."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
