"""Generalised advantage estimation (GAE) for PPO with a learned value function.

Runs on the whole batch or on a shard of its rows (``inputs.reduce``): the recursion is per row and the
whitening's statistics are batch-wide sums (rlsp.algos.whiten).

Shape legend: B rows (samples), R response length.
"""

from __future__ import annotations

import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.registry import register_adv_estimator
from rlsp.algos.whiten import masked_whiten


@register_adv_estimator("gae", uses=("gamma", "lam", "values_BR", "reduce"))
def compute_gae_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR) from rewards and the critic's ``values_BR`` (required).

    Over the masked-in tokens t of a row (t' = the next masked-in token, none after the last):
    delta_t = r_t + gamma * V_t' - V_t (V after the last token is 0: the response is terminal),
    A_t = delta_t + gamma * lam * A_t'. returns = A + V (unwhitened); advantages = A whitened over
    all masked-in tokens of the batch (mean 0, unbiased variance 1, ``eps`` added to the variance; over
    every shard with ``reduce``). Masked-out
    tokens are skipped by the recursion and get 0. ``index`` is ignored; ``norm_adv_by_std`` must
    stay True (whitening is intrinsic).
    """
    values_BR, rewards_BR = inputs.values_BR, inputs.token_level_rewards_BR
    if values_BR is None:
        raise ValueError("advantage estimator 'gae' needs values_BR (critic values), got None")
    if values_BR.shape != rewards_BR.shape:
        raise ValueError(f"values_BR shape {tuple(values_BR.shape)} != rewards shape {tuple(rewards_BR.shape)}")
    keep_BR = inputs.response_mask_BR.bool()
    raw_adv_BR = torch.zeros_like(rewards_BR)
    next_value_B = values_BR.new_zeros(values_BR.shape[0])
    next_adv_B = torch.zeros_like(next_value_B)
    for t in reversed(range(values_BR.shape[1])):
        delta_B = rewards_BR[:, t] + inputs.gamma * next_value_B - values_BR[:, t]
        adv_B = delta_B + inputs.gamma * inputs.lam * next_adv_B
        # Carry the recursion state past masked-out tokens unchanged.
        next_value_B = torch.where(keep_BR[:, t], values_BR[:, t], next_value_B)
        next_adv_B = torch.where(keep_BR[:, t], adv_B, next_adv_B)
        raw_adv_BR[:, t] = torch.where(keep_BR[:, t], adv_B, torch.zeros_like(adv_B))
    returns_BR = torch.where(keep_BR, raw_adv_BR + values_BR, torch.zeros_like(raw_adv_BR))
    advantages_BR = masked_whiten(raw_adv_BR, inputs.response_mask_BR, eps=inputs.eps, reduce=inputs.reduce)
    return advantages_BR, returns_BR
