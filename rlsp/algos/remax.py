"""ReMax advantages: the reward of the prompt's greedy response is the baseline.

"ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large Language
Models" (arXiv:2310.10505). For a prompt x, a sampled response y and the greedy response
y_bar = argmax decoding of the same policy, the REINFORCE gradient with the greedy baseline is

    sum_t grad log pi(y_t | x, y_<t) * (r(x, y) - r(x, y_bar)),

so no critic and no group of samples is needed: one extra greedy generation per prompt (the trainer
runs it, rlsp/step/baselines.py) gives b(x) = r(x, y_bar). As verl's "remax" estimator does, the
token-level form uses the undiscounted reward-to-go G_t = sum_{t' >= t} r_t' (equal to r(x, y) at every
token for an outcome reward), and A_t = G_t - b(x).

Shape legend: B rows (samples), R response length.
"""

from __future__ import annotations

import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.registry import register_adv_estimator
from rlsp.algos.reinforce_pp import compute_returns_to_go


@register_adv_estimator("remax", uses=("reward_baselines_B",))
def compute_remax_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR).

    returns G_t = sum of the row's token rewards from t on, over masked-in tokens (no discount);
    advantages A_t = G_t - b, with b = ``reward_baselines_B`` (the reward of the row's prompt's greedy
    response, required). Masked-out tokens get 0 in both (verl leaves G_t on holes inside a row; the
    loss never reads them). Groups are not used (``index`` is ignored); ``norm_adv_by_std``,
    ``gamma``, ``lam`` and the other optional inputs must stay at their defaults.
    """
    rewards_BR, mask_BR, baselines_B = inputs.token_level_rewards_BR, inputs.response_mask_BR, inputs.reward_baselines_B
    if baselines_B is None:
        raise ValueError("advantage estimator 'remax' needs reward_baselines_B (the greedy responses' rewards), got None")
    if baselines_B.shape != rewards_BR.shape[:1]:
        raise ValueError(f"reward_baselines_B shape {tuple(baselines_B.shape)}: need one baseline per row, "
                         f"[{rewards_BR.shape[0]}]")
    returns_BR = compute_returns_to_go(rewards_BR, mask_BR, gamma=1.0)
    keep_BR = mask_BR.bool()
    baseline_B1 = baselines_B.to(returns_BR.dtype).unsqueeze(-1)
    advantages_BR = torch.where(keep_BR, returns_BR - baseline_B1, torch.zeros((), dtype=returns_BR.dtype))
    return advantages_BR, returns_BR
