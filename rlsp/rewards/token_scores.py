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

`shaped_row_sums` is each row's sum of those scores from per-row values alone (DAPO's dynamic sampling
compares it within a group: verl's seq_reward): a row's reward and penalty sit on one token, so their sum
is the row's, bit for bit; the reward model's token scores enter as their row sum, the step rewards as
their sum over the row's policy tokens (the columns' sums add them in another order: equal up to roundoff).

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


def shaped_row_sums(response_tokens_B: torch.Tensor, row_reward_B: torch.Tensor | None = None,
                    rm_sum_B: torch.Tensor | None = None, overlong_B: torch.Tensor | None = None,
                    step_sum_B: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B] `shaped_token_scores(...).sum(-1)` from per-row values (module docstring): `response_tokens_B` the
    row's policy tokens (a row without any gets no reward or penalty), `rm_sum_B` the reward model's token
    scores summed over the row (in place of `row_reward_B`), `step_sum_B` its step rewards summed over its policy
    tokens; `dtype` is the response mask's (rlsp.workers.rollout_rows builds it float32), the dtype of rule
    rewards on their token."""
    if rm_sum_B is not None:
        if overlong_B is not None:  # validate_dapo refuses overlong shaping with a reward model
            raise ValueError("row sums of the reward model's scores with an overlong penalty are not defined here: "
                             "rlsp shapes rule rewards only (reward.reward_kwargs.overlong_buffer_cfg needs "
                             "reward_model.enable=false)")
        sums_B = rm_sum_B  # in the reward model's dtype, as its token scores are
    elif row_reward_B is not None:
        has_tokens_B = response_tokens_B > 0
        reward_B = row_reward_B.to(dtype)  # place_scores: the reward in the mask's dtype, on a policy token
        if overlong_B is not None:
            reward_B = reward_B + overlong_B.to(dtype)
        sums_B = torch.where(has_tokens_B, reward_B, torch.zeros_like(reward_B))
    else:
        raise ValueError("row sums of the token-level scores need each row's reward (row_reward_B) or the reward "
                         "model's row sums (rm_sum_B); got neither")
    return sums_B if step_sum_B is None else sums_B + step_sum_B
