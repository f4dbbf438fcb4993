"""GRPO advantages: outcome score normalised within each prompt group.

Shape legend: B rows (samples), R response length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlsp.algos.aggregation import group_mean_std, masked_sum
from rlsp.algos.registry import register_adv_estimator


@register_adv_estimator("grpo", uses=("norm_adv_by_std",))
def compute_grpo_advantages(
    token_level_rewards_BR: torch.Tensor,
    response_mask_BR: torch.Tensor,
    index: Sequence[str] | np.ndarray,
    *,
    norm_adv_by_std: bool = True,
    gamma: float = 1.0,
    lam: float = 1.0,
    values_BR: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR); returns equal the advantages.

    Row score s = sum of the row's token rewards over its response. Within each group g:
    a = (s - mean_g) / (std_g + eps) if ``norm_adv_by_std`` else s - mean_g, with std_g the
    *unbiased* (Bessel-corrected, n-1) standard deviation, as ``torch.std`` computes it. A group of
    size 1 uses mean 0 and std 1, i.e. its advantage is its raw score (divided by 1 + eps).
    The row advantage is broadcast to every response token; masked-out tokens get 0.
    ``gamma``, ``lam`` and ``values_BR`` are unused and must stay at their defaults.
    """
    scores_B = masked_sum(token_level_rewards_BR, response_mask_BR, dim=-1)
    mean_B, std_B, _ = group_mean_std(scores_B, index)
    adv_B = scores_B - mean_B
    if norm_adv_by_std:
        adv_B = adv_B / (std_B + eps)
    advantages_BR = adv_B.unsqueeze(-1) * response_mask_BR.to(adv_B.dtype)
    return advantages_BR, advantages_BR
