"""Optimizer and learning-rate schedule of a trainable engine (AdamW, linear warm-up then constant)."""

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
    optimizer = torch.optim.AdamW(module.parameters(), lr=s.lr, betas=tuple(s.betas), weight_decay=s.weight_decay)
    warmup = max(1, s.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return optimizer, scheduler
