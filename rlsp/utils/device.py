"""Devices and process-group backends: chosen once, here, for every worker.

`auto` picks cuda when a GPU is visible, else cpu.

Backends (`backend_for`): a CPU run uses gloo for everything. A CUDA run uses one process group that
carries both kinds of tensors, `cpu:gloo,cuda:nccl`: NCCL moves device tensors (FSDP's all-gathers
and reduce-scatters, Ulysses all-to-alls, ring attention's blocks, tensor-parallel reductions) and
gloo moves host tensors (the small reductions that plan micro-batches, count tokens and reduce
metrics: their values are read on the host anyway, so sending them through the device would cost two
copies and a synchronisation each). NCCL alone has no host path: the first host-tensor reduction of
a step would stop with "No backend type associated with device type cpu". Every sub-group (device
meshes, Ulysses sub-groups) inherits the same pair from the default group.

Device identity (`same_device`): `torch.device("cuda")` names no index while every CUDA tensor lives
on `cuda:<i>`, so `tensor.device == torch.device("cuda")` is always False. Devices are compared by
type and resolved index (no index = the current device of that type), never as given; workers hold
resolved devices (`device_for`).
"""

from __future__ import annotations

import torch

DEVICE_TYPES = ("cpu", "cuda")  # trainer.device also takes "auto" (rlsp.config.choices.DEVICES)
HOST_BACKEND = "gloo"
DEVICE_BACKENDS = {"cuda": "nccl"}


def target_device_type(requested: str) -> str:
    """trainer.device -> the device type a run asks for ('auto': this machine's), without requiring
    that device here (`python -m rlsp.check` describes runs meant for other machines)."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested not in DEVICE_TYPES:
        raise ValueError(f"trainer.device={requested!r}; legal values: {['auto', *DEVICE_TYPES]}")
    return requested


def resolve_device_type(requested: str) -> str:
    """trainer.device -> the device type this process computes on ('cpu' or 'cuda'); it must be here."""
    device_type = target_device_type(requested)
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return device_type


def backend_for(device_type: str) -> str:
    """The process-group backend for a run on `device_type`: host tensors always travel over gloo,
    device tensors over the device's collective library ('cpu:gloo,cuda:nccl' on CUDA)."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device type {device_type!r}; legal values: {list(DEVICE_TYPES)}")
    if device_type == "cpu":
        return HOST_BACKEND
    return f"cpu:{HOST_BACKEND},{device_type}:{DEVICE_BACKENDS[device_type]}"


def device_for(device_type: str) -> torch.device:
    """The device this process computes on, with its index resolved (cuda -> cuda:<current device>)."""
    return resolve_device(torch.device(device_type))


def resolve_device(device: torch.device | str) -> torch.device:
    """`device` with an explicit index: the current device of its type when it names none (CPU and
    other host-like types keep no index: all host memory is one device)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.device("cuda", _index(device))
    return torch.device(device.type)


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two devices are the same memory: type and resolved index (`cuda` is `cuda:0` when 0
    is the current device; `cpu` is `cpu:0`)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.type != "cuda" or a.index == b.index or _index(a) == _index(b)


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0
