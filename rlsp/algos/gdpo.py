"""GDPO advantages: each reward component normalised within its group on its own, then summed and whitened.

GDPO, "Group reward-Decoupled normalization Policy Optimization" (arXiv:2601.05242). With several
rewards r^1..r^K per response (e.g. accuracy and format), GRPO normalises their sum, so a component
with a large spread drowns the others and distinct reward combinations collapse onto the same
advantage. GDPO normalises each component within the prompt's group first:

    A^k_i = (r^k_i - mean_g(r^k)) / (std_g(r^k) + eps)          (per component k, group g of row i)
    S_i   = sum_k w_k * A^k_i                                    (w_k = algorithm.gdpo_reward_weights, or 1)
    A_i,t = (S_i - mean(S)) / sqrt(var(S) + 1e-8)               (whitened over all response tokens)

std_g is the unbiased (n-1) group standard deviation; a group of one row uses mean 0 and std 1 (its
A^k is the raw component), as rlsp's grpo does. The last step is verl's masked whitening: mean and
unbiased variance over every masked-in token of the batch (so a row weighs by its length), 1e-8 added
to the variance. The normalisation within groups is local to a shard that holds whole groups and the
whitening's statistics are batch-wide sums (`inputs.reduce`, rlsp.algos.whiten), so the policy workers run
it on their shards (rlsp.workers.step_stage). verl's "gdpo" estimator computes the same; it always divides by the group std (it is
not handed algorithm.norm_adv_by_std_in_grpo), so rlsp's gdpo refuses norm_adv_by_std_in_grpo=false.

Shape legend: B rows (samples), R response length, K reward components.
"""

from __future__ import annotations

import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import group_mean_std
from rlsp.algos.registry import register_adv_estimator
from rlsp.algos.whiten import masked_whiten

WHITEN_EPS = 1e-8  # verl's masked_whiten constant for the final batch-level step


def component_weights(names: list[str], weights: tuple[float, ...] | None) -> list[float]:
    """One weight per component: `weights` (same length as `names`) or all 1."""
    if weights is None:
        return [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(f"gdpo_reward_weights has {len(weights)} entries for {len(names)} reward components "
                         f"{names}; give one weight per component or none (all 1)")
    return [float(w) for w in weights]


@register_adv_estimator("gdpo", uses=("gdpo_reward_weights", "reward_components", "reduce"), groups=True)
def compute_gdpo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR); returns equal the advantages (an outcome estimator, as in verl).

    ``reward_components`` (required) maps each component name to its per-row value [B]; each is
    normalised within the rows' groups (``index``), weighted by ``gdpo_reward_weights`` and summed; the
    sum is broadcast over each row's masked-in tokens and whitened over all of them (module docstring; over
    every shard with ``reduce``, each group whole in one shard).
    ``token_level_rewards_BR`` is not read (the components are the reward); masked-out tokens get 0.
    """
    components = inputs.reward_components
    if not components:
        raise ValueError("advantage estimator 'gdpo' needs reward_components (name -> per-row reward), got none")
    mask_BR = inputs.response_mask_BR
    num_rows = mask_BR.shape[0]
    names = list(components)
    weights = component_weights(names, inputs.gdpo_reward_weights)
    total_B = torch.zeros(num_rows, dtype=inputs.token_level_rewards_BR.dtype, device=mask_BR.device)
    for name, weight in zip(names, weights):
        values_B = components[name].to(total_B)
        if values_B.shape != (num_rows,):
            raise ValueError(f"reward component {name!r} has shape {tuple(values_B.shape)}; need one value per "
                             f"row, [{num_rows}]")
        mean_B, std_B, _ = group_mean_std(values_B, inputs.index)
        total_B = total_B + weight * (values_B - mean_B) / (std_B + inputs.eps)
    summed_BR = total_B.unsqueeze(-1) * mask_BR.to(total_B.dtype)
    advantages_BR = masked_whiten(summed_BR, mask_BR, eps=WHITEN_EPS, reduce=inputs.reduce)
    return advantages_BR, advantages_BR
