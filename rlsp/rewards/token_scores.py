"""A step's token-level scores from per-row values: the one formula the driver and the policy workers share.

    scores_BR = each row's reward on its last policy token (rlsp.rewards.scoring.place_scores),
                or the reward model's token scores;
              + the row's overlong penalty on that same token (rlsp.rewards.overlong, dapo's shaping);
              + the agent loop's step rewards, each at the end of the turn that earned it
                (actor_rollout_ref.rollout.multi_turn.use_step_rewards).

The driver keeps the per-row parts (reward, penalty) and builds the columns only if it reads them; the
workers' step stage (rlsp.workers.step_stage) builds them from the same parts for its rows, so the driver
never sends [rows x response] scores. The operations are those of the driver's former in-place steps, in
their order and dtype, so both give the same tensors bit for bit.

Shape legend: B rows, R response length.
"""

from __future__ import annotations

import torch

from rlsp.data.batch import last_policy_token
from rlsp.rewards.scoring import place_scores


def shaped_token_scores(mask_BR: torch.Tensor, row_reward_B: torch.Tensor | None = None,
                        rm_scores_BR: torch.Tensor | None = None, overlong_B: torch.Tensor | None = None,
                        step_rewards_BR: torch.Tensor | None = None) -> torch.Tensor:
    """[B, R] token-level scores (module docstring): from `rm_scores_BR` when given, else from `row_reward_B`."""
    if rm_scores_BR is not None:
        scores_BR = rm_scores_BR
    elif row_reward_B is not None:
        scores_BR = place_scores(row_reward_B.tolist(), mask_BR)
    else:
        raise ValueError("token-level scores need each row's reward (row_reward_B) or the reward model's token "
                         "scores (rm_scores_BR); got neither")
    if overlong_B is not None:
        scores_BR = scores_BR.clone()
        scores_BR[torch.arange(len(scores_BR)), last_policy_token(mask_BR)] += overlong_B.to(scores_BR.dtype)
        scores_BR = scores_BR * (mask_BR > 0)  # a row without policy tokens gets nothing
    if step_rewards_BR is not None:
        scores_BR = scores_BR + step_rewards_BR * mask_BR
    return scores_BR
