"""Device selection: `auto` picks cuda/nccl when a GPU is visible, else cpu/gloo."""

from __future__ import annotations

import torch


def resolve_device_type(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device={requested!r}; legal values: ['auto', 'cpu', 'cuda']")
    return requested


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"
