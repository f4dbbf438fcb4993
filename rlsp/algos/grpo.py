"""GRPO advantages: outcome score normalised within each prompt group.

Shape legend: B rows (samples), R response length.
"""

from __future__ import annotations

import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import group_mean_std, masked_sum
from rlsp.algos.registry import register_adv_estimator


@register_adv_estimator("grpo", uses=("norm_adv_by_std",), groups=True)
def compute_grpo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR); returns equal the advantages.

    Row score s = sum of the row's token rewards over its response. Within each group g:
    a = (s - mean_g) / (std_g + eps) if ``norm_adv_by_std`` else s - mean_g, with std_g the
    *unbiased* (Bessel-corrected, n-1) standard deviation, as ``torch.std`` computes it. A group of
    size 1 uses mean 0 and std 1, i.e. its advantage is its raw score (divided by 1 + eps).
    The row advantage is broadcast to every response token; masked-out tokens get 0.
    ``gamma``, ``lam`` and ``values_BR`` are unused and must stay at their defaults.
    """
    scores_B = masked_sum(inputs.token_level_rewards_BR, inputs.response_mask_BR, dim=-1)
    mean_B, std_B, _ = group_mean_std(scores_B, inputs.index)
    adv_B = scores_B - mean_B
    if inputs.norm_adv_by_std:
        adv_B = adv_B / (std_B + inputs.eps)
    advantages_BR = adv_B.unsqueeze(-1) * inputs.response_mask_BR.to(adv_B.dtype)
    return advantages_BR, advantages_BR
