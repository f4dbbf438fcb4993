"""KL-in-reward: the penalty subtracted from token rewards and the controllers of its coefficient.

With ``algorithm.use_kl_in_reward`` the token rewards become ``scores - beta * KL_t`` where KL_t is a
per-token estimate of KL(actor_old || ref) on the sampled tokens. ``beta`` is fixed, or adapted after
every batch towards a target KL (Ziegler et al., 2019):

    e = clip(KL / target - 1, -0.2, 0.2);   beta <- beta * (1 + e * n_samples / horizon)

Shape legend: B rows (samples), R response length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlsp.algos.aggregation import masked_mean
from rlsp.algos.kl import compute_kl

# The adaptive controller never moves the coefficient by more than this proportional error.
ADAPTIVE_ERROR_CLIP = 0.2


@dataclass
class FixedKLController:
    """beta stays at ``value``."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """beta follows the proportional rule in the module docstring."""

    value: float
    target_kl: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target_kl <= 0 or self.horizon < 1:
            raise ValueError(f"adaptive KL control needs target_kl > 0 and horizon >= 1, got {self.target_kl}, "
                             f"{self.horizon}")

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def build_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> KLController:
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {kind!r}; legal: 'fixed', 'adaptive'")


def compute_kl_penalty(
    token_level_scores_BR: torch.Tensor,
    old_logprobs_BR: torch.Tensor,
    ref_logprobs_BR: torch.Tensor,
    response_mask_BR: torch.Tensor,
    beta: float,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_level_rewards_BR, kl_B): rewards = scores - beta * KL_t on masked-in tokens (0 elsewhere),
    and each row's token-mean KL (0 for a row without tokens). Row by row: any split of the rows gives
    the same values."""
    kl_BR = compute_kl(old_logprobs_BR, ref_logprobs_BR, kind)
    mask = response_mask_BR.bool()
    rewards_BR = torch.where(mask, token_level_scores_BR - beta * kl_BR, torch.zeros_like(kl_BR))
    return rewards_BR, masked_mean(kl_BR, response_mask_BR, dim=-1)


def batch_kl(kl_B: torch.Tensor) -> float:
    """The batch's KL for the adaptive controller: the mean over rows of each row's token-mean KL."""
    return float(kl_B.mean()) if kl_B.numel() else 0.0


def apply_kl_penalty(
    token_level_scores_BR: torch.Tensor,
    old_logprobs_BR: torch.Tensor,
    ref_logprobs_BR: torch.Tensor,
    response_mask_BR: torch.Tensor,
    beta: float,
    kind: str,
) -> tuple[torch.Tensor, float]:
    """(token_level_rewards_BR, current_kl): :func:`compute_kl_penalty` on the whole batch, with
    current_kl = :func:`batch_kl` (the quantity the adaptive controller tracks)."""
    rewards_BR, kl_B = compute_kl_penalty(token_level_scores_BR, old_logprobs_BR, ref_logprobs_BR, response_mask_BR,
                                          beta, kind)
    return rewards_BR, batch_kl(kl_B)
