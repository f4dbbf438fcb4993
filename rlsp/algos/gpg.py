"""GPG advantages: group-mean baseline scaled by a batch-level correction factor.

"GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning" (arXiv:2504.02546).
The paper's advantage for response i of a group, in a batch of B responses, is

    A_i = alpha * (r_i - mean_group(r)) / F_norm,        alpha = B / (B - M),

where M counts the "invalid" responses (those of groups whose responses all got the same reward, so
their advantage is 0) and F_norm is 1 (or the group's std). alpha undoes the dilution of the
batch-mean loss by those zero-signal responses.

rlsp follows verl's "gpg" estimator, which differs from the paper in two places: M is taken as the
number of responses whose *score* is exactly 0, i.e. alpha = B / max(#{i : r_i != 0}, 1), and
F_norm is always 1 (verl computes the group std but never divides by it, and has no setting for it).
With 0/1 rewards alpha is therefore B / (number of correct responses in the batch).

Shape legend: B rows (samples), R response length.
"""

from __future__ import annotations

import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import group_mean_std, masked_sum
from rlsp.algos.registry import register_adv_estimator
from rlsp.algos.whiten import Reduce


def gpg_alpha(scores_B: torch.Tensor, reduce: Reduce | None = None) -> torch.Tensor:
    """verl's correction factor: rows in the batch / rows with a non-zero score (floored at 1), a scalar.
    With `reduce` the rows are a shard and both counts are summed over the shards (integers: exact)."""
    counts = torch.stack([torch.tensor(scores_B.shape[0]), torch.count_nonzero(scores_B)]).to(scores_B.dtype)
    rows, nonzero = counts if reduce is None else reduce(counts)
    return nonzero.clamp_min(1).reciprocal() * rows  # as `rows / tensor` evaluates it (unchanged bits)


@register_adv_estimator("gpg", uses=("reduce",), groups=True)
def compute_gpg_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR); returns equal the advantages (an outcome estimator, as in verl).

    Row score s = sum of the row's token rewards over its response. a = alpha * (s - mean_g), with
    mean_g the mean score of the row's group (0 for a group of one row, whose advantage is then
    alpha * s) and alpha from :func:`gpg_alpha` over the whole batch (every shard with ``reduce``, each group
    whole in one shard), broadcast to every response token; masked-out tokens get exactly 0. No std
    normalisation, so ``norm_adv_by_std``, ``gamma``, ``lam`` and ``values_BR`` must stay at their defaults;
    ``eps`` is unused.
    """
    keep_BR = inputs.response_mask_BR.bool()
    scores_B = masked_sum(inputs.token_level_rewards_BR, inputs.response_mask_BR, dim=-1)
    mean_B, _, _ = group_mean_std(scores_B, inputs.index)
    adv_B = gpg_alpha(scores_B, inputs.reduce) * (scores_B - mean_B)
    advantages_BR = torch.where(keep_BR, adv_B.unsqueeze(-1), torch.zeros((), dtype=adv_B.dtype))
    return advantages_BR, advantages_BR
