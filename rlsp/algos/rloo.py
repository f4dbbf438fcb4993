"""RLOO advantages: each sample's score minus the mean score of the *other* samples of its group.

Shape legend: B rows (samples), R response length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlsp.algos.aggregation import group_mean_std, masked_sum
from rlsp.algos.registry import register_adv_estimator


@register_adv_estimator("rloo", uses=())
def compute_rloo_advantages(
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

    a_i = s_i - mean_{j != i, j in group(i)} s_j = n/(n-1) * (s_i - mean_g), with s the row's summed
    token rewards. A group of size 1 has no other sample: its baseline is 0 and its advantage is its
    raw score (the same convention as GRPO's single-member groups). No std normalisation, so
    ``norm_adv_by_std``, ``gamma``, ``lam`` and ``values_BR`` must stay at their defaults; ``eps`` is
    unused. The row advantage is broadcast over response tokens; masked-out tokens get 0.
    """
    scores_B = masked_sum(token_level_rewards_BR, response_mask_BR, dim=-1)
    mean_B, _, count_B = group_mean_std(scores_B, index)
    # n/(n-1) rescales the centred score into the leave-one-out form; size-1 groups keep factor 1.
    factor_B = torch.where(count_B > 1, count_B / (count_B - 1).clamp_min(1.0), torch.ones_like(count_B))
    adv_B = (scores_B - mean_B) * factor_B
    advantages_BR = adv_B.unsqueeze(-1) * response_mask_BR.to(adv_B.dtype)
    return advantages_BR, advantages_BR
