"""The learning-rate schedule of a trainable engine: a factor of optim.lr per optimizer step (verl's
`optim.lr_scheduler_type`).

    constant  linear warm-up over the first `warmup` optimizer steps (the first step already at 1/warmup), then 1
    cosine    verl's cosine: steps counted from 0 (`zero_indexed_step`, else from 1); a linear warm-up from 0
              over `warmup` steps, then the factor follows half a cosine period per `num_cycles` = 0.5 from 1
              down to `min_lr_ratio` at the last step: min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(2 pi
              num_cycles p)) / 2 with p the fraction of the steps after the warm-up, never below min_lr_ratio

Steps are optimizer steps (mini-batches x ppo_epochs per training step, as the warm-up: rlsp.config.run_length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class Schedule:
    kind: str = "constant"
    warmup: int = 0  # optimizer steps of the linear warm-up
    total: int = 0  # optimizer steps of the whole run (cosine)
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    zero_indexed_step: bool = True


def compute_lr_factor(s: Schedule, step: int) -> float:
    """The factor of optim.lr at optimizer step `step` (0 for the first)."""
    if s.kind == "constant":
        return min(1.0, (step + 1) / s.warmup) if s.warmup > 0 else 1.0
    if s.kind != "cosine":
        raise ValueError(f"optim.lr_scheduler_type={s.kind!r} is not supported; legal values: {list(SCHEDULES)}")
    t = step if s.zero_indexed_step else step + 1
    if t < s.warmup:
        return t / s.warmup
    progress = (t - s.warmup) / max(1, s.total - s.warmup)
    cosine = (1.0 + math.cos(2.0 * math.pi * s.num_cycles * progress)) / 2.0
    return max(s.min_lr_ratio, s.min_lr_ratio + (1.0 - s.min_lr_ratio) * cosine)
