"""Backends and device identity (rlsp.utils.device): what the workers' process group carries, and
devices compared by type and resolved index."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlsp.utils.device import backend_for, resolve_device, same_device


def test_cuda_group_carries_host_and_device_tensors():
    assert backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert backend_for("cpu") == "gloo"
    # torch parses it as one backend per device type: host tensors over gloo, CUDA tensors over NCCL
    config = dist.BackendConfig(dist.Backend(backend_for("cuda")))
    assert config.get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    with pytest.raises(ValueError, match=r"device type 'npu'; legal values: \['cpu', 'cuda'\]"):
        backend_for("npu")


def test_devices_compare_by_type_and_resolved_index():
    # torch compares devices as given: an index-less device differs from every tensor's device
    assert torch.zeros(1).device != torch.device("cpu", 0)
    assert same_device(torch.zeros(1).device, torch.device("cpu", 0))
    assert same_device("cpu", torch.device("cpu"))
    assert not same_device("cpu", "meta") and not same_device("cpu", "cuda:0")
    assert same_device("cuda:1", "cuda:1") and not same_device("cuda:0", "cuda:1")
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert same_device("cuda", f"cuda:{current}") and not same_device("cuda", f"cuda:{current + 1}")
    assert resolve_device(torch.device("cpu", 0)) == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_resolves_to_the_current_index():
    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
