"""What the machine a command runs on offers the run: its device type and the memory of one rank.

Read before any worker has the run's config and without importing torch (the config stage answers in about a
second): the device type is `trainer.device` when it names one; for `auto` it is torch's answer when
torch is already imported, else whether `nvidia-smi` lists a GPU this process may use
(`CUDA_VISIBLE_DEVICES` respected). A rank's memory is the smallest visible GPU's total memory on
cuda (one rank per GPU), the host's memory shared by the node's ranks on cpu. Either can be unknown
(no `nvidia-smi` on the machine running `python -m rlsp.check` for a GPU cluster): the `auto`
settings (rlsp.config.auto) then fall back to verl's defaults and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import psutil

GIB = 1024**3


@dataclass(frozen=True)
class Machine:
    device: str  # cpu | cuda
    rank_memory: float | None  # bytes one rank may use; None: unknown here
    source: str  # how both were found (printed with the choices they decide)


def _torch_gpus() -> list[float] | None:
    """Total memory of each visible GPU by torch, when torch is imported already (else None)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def _smi_gpus() -> list[float]:
    """Total memory of each GPU `nvidia-smi` lists that CUDA_VISIBLE_DEVICES leaves to this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return []
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    mib = [float(x) for x in out.split() if x.replace(".", "", 1).isdigit()]
    if visible is not None:  # integer indices only (UUIDs: every listed GPU counts)
        picks = [int(x) for x in visible.split(",") if x.strip().isdigit()]
        mib = [mib[i] for i in picks if i < len(mib)] if picks else mib
    return [m * 1024**2 for m in mib]


def machine_facts(requested_device: str, ranks_per_node: int) -> Machine:
    """The device type `trainer.device=requested_device` gives here and one rank's memory."""
    gpus = _torch_gpus()
    how = "torch"
    if gpus is None:
        gpus, how = _smi_gpus(), "nvidia-smi"
    device = requested_device if requested_device in ("cpu", "cuda") else ("cuda" if gpus else "cpu")
    if device == "cuda":
        if not gpus:
            return Machine("cuda", None, "no GPU visible here: its memory is unknown")
        return Machine("cuda", min(gpus), f"{len(gpus)} GPU(s) of {min(gpus) / GIB:.0f} GiB ({how})")
    host = psutil.virtual_memory().total
    ranks = max(1, ranks_per_node)
    return Machine("cpu", host / ranks, f"host memory {host / GIB:.0f} GiB shared by {ranks} rank(s) per node")
