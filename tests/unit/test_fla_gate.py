"""When rlsp runs Gated DeltaNet through flash-linear-attention on CUDA: never where fla refuses the backward.

fla refuses the gated backward on Hopper (compute capability 9.x) with Triton >= 3.4.0 and < 3.7.1 unless tilelang
is installed; `fla_trains_on` must say False exactly there (and True on other GPUs and Triton versions), so the
old-logprob pass and the update both take the torch path. The device query and the triton version are the inputs.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rlsp.models import linear_attention as la


@pytest.mark.parametrize(("capability", "triton_version", "expected"), [
    ((9, 0), "3.4.0", False), ((9, 0), "3.6.0", False), ((9, 0), "3.7.0+git1234", False),
    ((9, 0), "3.7.1", True), ((9, 0), "3.3.1", True), ((8, 0), "3.5.0", True), ((10, 0), "3.5.0", True),
])
def test_fla_trains_on(monkeypatch, capability, triton_version, expected):
    la.fla_trains_on.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton_version))
    monkeypatch.setattr(la.importlib.util, "find_spec", lambda name: None)
    with pytest.warns(UserWarning, match="torch path") if not expected else _no_warning():
        assert la.fla_trains_on(0) is expected
    la.fla_trains_on.cache_clear()


class _no_warning:
    def __enter__(self):
        import warnings
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def test_tilelang_brings_fla_back(monkeypatch):
    la.fla_trains_on.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.5.0"))
    monkeypatch.setattr(la.importlib.util, "find_spec", lambda name: object() if name == "tilelang" else None)
    assert la.fla_trains_on(0) is True
    la.fla_trains_on.cache_clear()
