"""REINFORCE++ advantages: discounted return-to-go whitened over the batch, and the group-baseline
variant (outcome score minus its group mean, whitened over the batch).

The plain variant runs on the whole batch or on a shard of its rows (``inputs.reduce``: the whitening's
statistics are batch-wide sums, rlsp.algos.whiten); so does the baseline variant, given shards that hold
whole groups (its group means are local, its whitening a batch-wide sum).

Shape legend: B rows (samples), R response length.
"""

from __future__ import annotations

import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import group_mean_std, masked_sum
from rlsp.algos.registry import register_adv_estimator
from rlsp.algos.whiten import masked_whiten as whiten_shards


def compute_returns_to_go(
    token_level_rewards_BR: torch.Tensor, response_mask_BR: torch.Tensor, gamma: float
) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over masked-in tokens only; 0 on masked-out tokens.

    "next" is the next masked-in token of the row, so a hole in the mask (e.g. tokens not produced
    by the policy) is skipped rather than discounted; rewards on masked-out tokens are dropped.
    """
    keep_BR = response_mask_BR.bool()
    rewards_BR = torch.where(keep_BR, token_level_rewards_BR, torch.zeros_like(token_level_rewards_BR))
    returns_BR = torch.zeros_like(rewards_BR)
    running_B = rewards_BR.new_zeros(rewards_BR.shape[0])
    for t in reversed(range(rewards_BR.shape[1])):
        running_B = torch.where(keep_BR[:, t], rewards_BR[:, t] + gamma * running_B, running_B)
        returns_BR[:, t] = torch.where(keep_BR[:, t], running_B, torch.zeros_like(running_B))
    return returns_BR


@register_adv_estimator("reinforce_plus_plus", uses=("gamma", "reduce"))
def compute_reinforce_pp_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR).

    returns = discounted return-to-go (:func:`compute_returns_to_go`); advantages = returns whitened
    over all masked-in tokens of the batch (mean 0, unbiased variance 1, ``eps`` added to the
    variance; over every shard with ``reduce``). Groups are not used (``index`` is ignored). Whitening is intrinsic, so
    ``norm_adv_by_std``, ``lam`` and ``values_BR`` must stay at their defaults.
    """
    returns_BR = compute_returns_to_go(inputs.token_level_rewards_BR, inputs.response_mask_BR, inputs.gamma)
    advantages_BR = whiten_shards(returns_BR, inputs.response_mask_BR, eps=inputs.eps, reduce=inputs.reduce)
    return advantages_BR, returns_BR


@register_adv_estimator("reinforce_plus_plus_baseline", uses=("reduce",), groups=True)
def compute_reinforce_pp_baseline_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR).

    Row score s = summed token rewards; s - mean_g (group mean; 0 for a group of size 1, as in GRPO)
    is broadcast over the row's response tokens (returns), then whitened over all masked-in tokens
    of the batch (advantages; over every shard with ``reduce``, each group whole in one shard). Outcome-level,
    so no discounting: ``gamma``, ``lam``,
    ``norm_adv_by_std`` and ``values_BR`` must stay at their defaults.
    """
    scores_B = masked_sum(inputs.token_level_rewards_BR, inputs.response_mask_BR, dim=-1)
    mean_B, _, _ = group_mean_std(scores_B, inputs.index)
    returns_BR = (scores_B - mean_B).unsqueeze(-1) * inputs.response_mask_BR.to(scores_B.dtype)
    advantages_BR = whiten_shards(returns_BR, inputs.response_mask_BR, eps=inputs.eps, reduce=inputs.reduce)
    return advantages_BR, returns_BR
