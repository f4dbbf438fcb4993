"""RLOO advantages: each sample's score minus the mean score of the *other* samples of its group.

Shape legend: B rows (samples), R response length.
"""

from __future__ import annotations

import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import group_mean_std, masked_sum
from rlsp.algos.registry import register_adv_estimator


@register_adv_estimator("rloo", uses=(), groups=True)
def compute_rloo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR); returns equal the advantages.

    a_i = s_i - mean_{j != i, j in group(i)} s_j = n/(n-1) * (s_i - mean_g), with s the row's summed
    token rewards. A group of size 1 has no other sample: its baseline is 0 and its advantage is its
    raw score (the same convention as GRPO's single-member groups). No std normalisation, so
    ``norm_adv_by_std``, ``gamma``, ``lam`` and ``values_BR`` must stay at their defaults; ``eps`` is
    unused. The row advantage is broadcast over response tokens; masked-out tokens get 0.
    """
    scores_B = masked_sum(inputs.token_level_rewards_BR, inputs.response_mask_BR, dim=-1)
    mean_B, _, count_B = group_mean_std(scores_B, inputs.index)
    # n/(n-1) rescales the centred score into the leave-one-out form; size-1 groups keep factor 1.
    factor_B = torch.where(count_B > 1, count_B / (count_B - 1).clamp_min(1.0), torch.ones_like(count_B))
    adv_B = (scores_B - mean_B) * factor_B
    advantages_BR = adv_B.unsqueeze(-1) * inputs.response_mask_BR.to(adv_B.dtype)
    return advantages_BR, advantages_BR
