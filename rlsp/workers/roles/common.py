"""Helpers the roles share: optimizer settings from the config, the sampling temperature of a batch."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from rlsp.data.batch import Batch
from rlsp.engine.optim import OptimSettings


def optim_settings(optim: Any) -> OptimSettings:
    return OptimSettings(lr=float(optim.lr), betas=tuple(optim.betas), weight_decay=float(optim.weight_decay),
                         warmup_steps=int(optim.warmup_steps), grad_clip=float(optim.grad_clip))


def token_budget(enabled: bool, max_tokens: int) -> int | None:
    """Tokens per rank per micro-batch when token-budget micro-batching is on, else None (fixed rows)."""
    return int(max_tokens) if enabled else None


def batch_temperature(batch: Batch, cfg: DictConfig) -> float:
    """Logprobs are computed at the temperature the rows were sampled with."""
    return float(batch.info.get("temperature", cfg.actor_rollout_ref.rollout.temperature))
