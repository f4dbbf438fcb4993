"""Pass@k advantages: only the best response of each group is credited, by its margin over the runner-up.

"Optimizing Language Models for Inference Time Objectives using Reinforcement Learning"
(arXiv:2503.19595). For the pass@k (max@k) objective with k = the group size n, E[max_i r_i], the
leave-one-out policy gradient is sum_i (max_j r_j - max_{j != i} r_j) * grad log pi(o_i): the
coefficient is 0 for every response but the best, which gets its margin over the second best:

    A_best = r_(1) - r_(2),        A_i = 0 for every other response of the group,

with r_(1) >= r_(2) the two largest scores of the group. verl's "grpo_passk" then divides by
(std_g + eps), std_g the group's unbiased standard deviation, when algorithm.norm_adv_by_std_in_grpo
is true; rlsp does the same. A tie for the best score gives the whole group 0, whichever tied row is
called the best. Every group needs at least 2 responses.

Shape legend: B rows (samples), R response length, G groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import group_ids, group_mean_std, masked_sum
from rlsp.algos.registry import register_adv_estimator


def check_group_sizes(index: Sequence[str] | np.ndarray | torch.Tensor, num_rows: int) -> None:
    """ValueError unless there is one group id per row and every group has at least 2 rows."""
    if len(index) != num_rows:
        raise ValueError(f"need one group id per row: {len(index)} ids for {num_rows} rows")
    ids = index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
    uniques, counts = np.unique(ids, return_counts=True)
    lonely = uniques[counts < 2].tolist()
    if lonely:
        raise ValueError(f"advantage estimator 'grpo_passk' needs at least 2 samples per group "
                         f"(actor_rollout_ref.rollout.n >= 2); {len(lonely)} group(s) have 1: {lonely[:5]}")


def best_rows_and_margins(
    scores_B: torch.Tensor, gid_B: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(best_B: True on exactly one top-scoring row per group, the first such row; margin_G: best score
    minus the best score among the group's other rows). Groups must have at least 2 rows."""
    rows_B = torch.arange(scores_B.shape[0], device=scores_B.device)
    low_G = scores_B.new_full((num_groups,), float("-inf"))
    top_G = low_G.scatter_reduce(0, gid_B, scores_B, reduce="amax")
    at_top_B = torch.where(scores_B == top_G[gid_B], rows_B, scores_B.shape[0])
    first_G = torch.full_like(top_G, scores_B.shape[0], dtype=torch.long).scatter_reduce(
        0, gid_B, at_top_B, reduce="amin")
    best_B = rows_B == first_G[gid_B]
    others_B = torch.where(best_B, float("-inf"), scores_B)
    second_G = low_G.scatter_reduce(0, gid_B, others_B, reduce="amax")
    return best_B, top_G - second_G


@register_adv_estimator("grpo_passk", uses=("norm_adv_by_std",), groups=True)
def compute_grpo_passk_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR); returns equal the advantages (an outcome estimator, as in verl).

    Row score s = sum of the row's token rewards over its response. The best row of each group gets
    s_(1) - s_(2), divided by (std_g + eps) if ``norm_adv_by_std``; every other row gets 0. The row
    advantage is broadcast to every response token; masked-out tokens get exactly 0. A group of one
    row raises ValueError (verl refuses it too). ``gamma``, ``lam`` and ``values_BR`` are unused and
    must stay at their defaults.
    """
    keep_BR = inputs.response_mask_BR.bool()
    scores_B = masked_sum(inputs.token_level_rewards_BR, inputs.response_mask_BR, dim=-1)
    check_group_sizes(inputs.index, scores_B.shape[0])
    gid_B, num_groups = group_ids(inputs.index, scores_B.device)
    best_B, margin_G = best_rows_and_margins(scores_B, gid_B, num_groups)
    adv_B = torch.where(best_B, margin_G[gid_B], 0.0)
    if inputs.norm_adv_by_std:
        _, std_B, _ = group_mean_std(scores_B, inputs.index)
        adv_B = adv_B / (std_B + inputs.eps)
    advantages_BR = torch.where(keep_BR, adv_B.unsqueeze(-1), torch.zeros((), dtype=adv_B.dtype))
    return advantages_BR, advantages_BR
