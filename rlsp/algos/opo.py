"""OPO advantages: outcome score minus the group's length-weighted mean score.

"On-Policy RL with Optimal Reward Baseline" (arXiv:2505.23585). For a group of responses
o_1..o_G to one prompt with scores r_i and lengths |o_i| (tokens), the baseline that minimises the
policy-gradient variance, under the paper's assumption that a response's squared gradient norm grows
with its length, is

    b* = sum_i |o_i| * r_i / sum_i |o_i|,        A_i = r_i - b*,

with no division by the group's standard deviation. verl's "opo" estimator computes the same.

Shape legend: B rows (samples), R response length, G groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import group_ids, masked_sum
from rlsp.algos.registry import register_adv_estimator


def length_weighted_baseline(
    scores_B: torch.Tensor, lengths_B: torch.Tensor, index: Sequence[str] | np.ndarray | torch.Tensor
) -> torch.Tensor:
    """Per-row b* = sum(len * score) / sum(len) over the row's group, [B].

    A group of one row gets baseline 0 (verl's convention: its advantage is its raw score); a group
    whose rows have no response tokens at all (sum(len) = 0) also gets 0 instead of 0/0.
    """
    if scores_B.dim() != 1 or len(index) != scores_B.shape[0]:
        raise ValueError(f"need one group id per row: {len(index)} ids for scores {tuple(scores_B.shape)}")
    gid_B, num_groups = group_ids(index, scores_B.device)
    zeros_G = scores_B.new_zeros(num_groups)
    count_G = zeros_G.index_add(0, gid_B, torch.ones_like(scores_B))
    length_G = zeros_G.index_add(0, gid_B, lengths_B)
    weighted_G = zeros_G.index_add(0, gid_B, lengths_B * scores_B)
    usable_G = (count_G > 1) & (length_G > 0)
    baseline_G = torch.where(usable_G, weighted_G / torch.where(usable_G, length_G, 1.0), 0.0)
    return baseline_G[gid_B]


@register_adv_estimator("opo", uses=(), groups=True)
def compute_opo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR); returns equal the advantages (an outcome estimator, as in verl).

    Row score s = sum of the row's token rewards over its response; row length = its masked-in tokens.
    a = s - b*, with b* the length-weighted group mean (:func:`length_weighted_baseline`), broadcast
    to every response token; masked-out tokens get exactly 0. No std normalisation, so
    ``norm_adv_by_std``, ``gamma``, ``lam`` and ``values_BR`` must stay at their defaults; ``eps`` is
    unused.
    """
    keep_BR = inputs.response_mask_BR.bool()
    scores_B = masked_sum(inputs.token_level_rewards_BR, inputs.response_mask_BR, dim=-1)
    lengths_B = keep_BR.to(scores_B.dtype).sum(-1)
    adv_B = scores_B - length_weighted_baseline(scores_B, lengths_B, inputs.index)
    advantages_BR = torch.where(keep_BR, adv_B.unsqueeze(-1), torch.zeros((), dtype=adv_B.dtype))
    return advantages_BR, advantages_BR
