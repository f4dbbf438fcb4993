"""Optimizer and learning-rate schedule of a trainable engine (AdamW over the trainable parameters, linear warm-up then constant)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear warm-up over this many optimizer steps
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping


def build_optimizer(module: nn.Module, s: OptimSettings) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the parameters that require grad (all of them, or only LoRA adapters: frozen base
    weights get no optimizer state)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(module).__name__} has no trainable parameters to optimise")
    optimizer = torch.optim.AdamW(params, lr=s.lr, betas=tuple(s.betas), weight_decay=s.weight_decay)
    warmup = max(1, s.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return optimizer, scheduler
