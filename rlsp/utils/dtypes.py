"""Dtype names as the config spells them, and their torch dtypes."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """torch dtype for a config name (a torch dtype passes through); ValueError naming the legal names."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; legal values: {sorted(DTYPES)}")
    return DTYPES[name]
