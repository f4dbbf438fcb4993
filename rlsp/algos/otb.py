"""Optimal token baseline (OTB): a per-token baseline from the group, weighted by each path's gradient energy.

verl's "optimal_token_baseline" and "tir_optimal_token_baseline" estimators. The variance-minimising
baseline for a policy-gradient term sum_t grad log pi(y_t) * (G_t - b_t) weights each sample's return by
the squared norm of its score function. For a softmax policy the squared norm of the logit gradient of
log pi(y_j) is ||e_{y_j} - pi_j||^2 = 1 - 2 pi_j(y_j) + sum_v pi_j(v)^2 (pi_j the next-token
distribution at token j), so with the path-variance proxy accumulated up to token t

    w_j = 1 - 2 pi_j(y_j) + sum_v pi_j(v)^2,        W_t = sum_{j <= t} w_j,

the baseline at token t for a prompt group g of N >= 2 responses is

    B_t = sum_{i in g} G_{i,t} W_{i,t} / (sum_{i in g} W_{i,t} + 1e-8),        A_{i,t} = G_{i,t} - B_t,

with G_{i,t} the undiscounted reward-to-go of response i. A group of one response gets B = 0 (its
advantage is its return). pi_j(y_j) is exp(old logprob) of the sampled token and sum_v pi_j(v)^2 comes
from the actor's logprob pass (actor_rollout_ref.actor.calculate_sum_pi_squared=true). With rollout
importance weights rho the weights become rho_t^2 w_t (verl's correction for truncated IS).

The two variants differ in how tokens are lined up across a group:
- optimal_token_baseline: by column of the response (t = position in the padded response), responses
  of every length in the group; no zero tail.
- tir_optimal_token_baseline (multi-turn, tool-integrated): by rank among each response's own policy
  tokens (tool output and template tokens, masked out, are skipped), responses without policy tokens
  left out of the group; with the zero tail: when one response of a group is strictly the longest, its
  baseline is 0 beyond the second-longest length (no other response to compare with there).

Shape legend: B rows (samples), R response length, L a row's policy-token count (max over rows), G groups.
"""

from __future__ import annotations

import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import group_ids
from rlsp.algos.registry import register_adv_estimator
from rlsp.algos.reinforce_pp import compute_returns_to_go

OTB_EPS = 1e-8  # verl's constant in the baseline's denominator
USES = ("old_logprobs_BR", "sum_pi_squared_BR", "rollout_is_weights_BR")


def path_variance_BR(inputs: AdvantageInputs) -> torch.Tensor:
    """W_t = sum_{j <= t} w_j over masked-in tokens, w_j = (1 - 2 pi_j + sum pi^2) * (rho_j^2 if given)."""
    old_BR, spp_BR, mask_BR = inputs.old_logprobs_BR, inputs.sum_pi_squared_BR, inputs.response_mask_BR
    for name, value in (("old_logprobs_BR", old_BR), ("sum_pi_squared_BR", spp_BR)):
        if value is None:
            raise ValueError(f"the optimal token baseline needs {name} (the actor's logprob pass with "
                             "actor_rollout_ref.actor.calculate_sum_pi_squared=true), got None")
        if value.shape != mask_BR.shape:
            raise ValueError(f"{name} shape {tuple(value.shape)} != response mask shape {tuple(mask_BR.shape)}")
    dtype = inputs.token_level_rewards_BR.dtype
    w_BR = 1.0 - 2.0 * old_BR.to(dtype).exp() + spp_BR.to(dtype)
    if inputs.rollout_is_weights_BR is not None:
        w_BR = w_BR * inputs.rollout_is_weights_BR.to(dtype) ** 2
    keep_BR = mask_BR.bool()
    return torch.where(keep_BR, w_BR, torch.zeros((), dtype=dtype)).cumsum(-1)


def group_baselines(returns_BL: torch.Tensor, weight_BL: torch.Tensor, on_BL: torch.Tensor, gid_B: torch.Tensor,
                    num_groups: int, zero_tail: bool) -> torch.Tensor:
    """B per (row, position) = the row's group's sum(G W) / (sum(W) + eps) over rows `on` at that position;
    0 for rows of a one-row group; with `zero_tail` 0 past the second-longest row for a strictly longest one."""
    zeros_GL = returns_BL.new_zeros((num_groups, returns_BL.shape[1]))
    on_weight_BL = torch.where(on_BL, weight_BL, torch.zeros((), dtype=weight_BL.dtype))
    num_GL = zeros_GL.index_add(0, gid_B, returns_BL * on_weight_BL)
    den_GL = zeros_GL.index_add(0, gid_B, on_weight_BL) + OTB_EPS
    count_G = returns_BL.new_zeros(num_groups).index_add(0, gid_B, torch.ones_like(returns_BL[:, 0]))
    baseline_BL = torch.where((count_G > 1)[gid_B, None], (num_GL / den_GL)[gid_B], 0.0)
    if zero_tail:
        length_B = on_BL.sum(-1).to(returns_BL.dtype)
        top_G = returns_BL.new_full((num_groups,), -1.0).scatter_reduce(0, gid_B, length_B, reduce="amax")
        at_top_B = length_B == top_G[gid_B]
        tops_G = returns_BL.new_zeros(num_groups).index_add(0, gid_B, at_top_B.to(returns_BL.dtype))
        below_B = torch.where(at_top_B, -1.0, length_B)
        second_G = returns_BL.new_full((num_groups,), -1.0).scatter_reduce(0, gid_B, below_B, reduce="amax")
        lone_B = at_top_B & (tops_G[gid_B] == 1) & (count_G[gid_B] > 1)
        cols_L = torch.arange(returns_BL.shape[1], device=returns_BL.device, dtype=returns_BL.dtype)
        tail_BL = lone_B[:, None] & (cols_L[None, :] >= second_G[gid_B, None])
        baseline_BL = torch.where(tail_BL, 0.0, baseline_BL)
    return baseline_BL


def _otb(inputs: AdvantageInputs, compact: bool, zero_tail: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mask_BR = inputs.response_mask_BR
    keep_BR = mask_BR.bool()
    returns_BR = compute_returns_to_go(inputs.token_level_rewards_BR, mask_BR, gamma=1.0)
    weight_BR = path_variance_BR(inputs)
    rows = torch.ones(keep_BR.shape[0], dtype=torch.bool, device=keep_BR.device)
    if compact:  # line tokens up by their rank among the row's policy tokens; rows without any leave the groups
        rank_BR = keep_BR.long().cumsum(-1) - 1
        L = int(keep_BR.sum(-1).max()) if keep_BR.numel() else 0
        r_idx, c_idx = keep_BR.nonzero(as_tuple=True)
        packed_BL = returns_BR.new_zeros((keep_BR.shape[0], L))
        returns_BL, weight_BL = packed_BL.clone(), packed_BL.clone()
        returns_BL[r_idx, rank_BR[r_idx, c_idx]] = returns_BR[r_idx, c_idx]
        weight_BL[r_idx, rank_BR[r_idx, c_idx]] = weight_BR[r_idx, c_idx]
        on_BL = torch.arange(L, device=keep_BR.device)[None, :] < keep_BR.sum(-1, keepdim=True)
        rows = keep_BR.any(-1)
    else:
        returns_BL, weight_BL, on_BL = returns_BR, weight_BR, keep_BR
    index = [inputs.index[i] for i in rows.nonzero()[:, 0].tolist()]
    advantages_BR = torch.zeros_like(returns_BR)
    if index:
        gid_B, num_groups = group_ids(index, returns_BR.device)
        baseline_BL = group_baselines(returns_BL[rows], weight_BL[rows], on_BL[rows], gid_B, num_groups, zero_tail)
        adv_BL = returns_BL[rows] - baseline_BL
        if compact:
            r_idx, c_idx = keep_BR[rows].nonzero(as_tuple=True)
            sub_BR = torch.zeros_like(returns_BR[rows])
            sub_BR[r_idx, c_idx] = adv_BL[r_idx, (keep_BR[rows].long().cumsum(-1) - 1)[r_idx, c_idx]]
            advantages_BR[rows] = sub_BR
        else:
            advantages_BR = torch.where(keep_BR, adv_BL, torch.zeros((), dtype=adv_BL.dtype))
    return advantages_BR, returns_BR


@register_adv_estimator("optimal_token_baseline", uses=USES, groups=True)
def compute_otb_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR): A_t = G_t - B_t by response column (module docstring); returns the
    reward-to-go G. Masked-out tokens get 0 in both. ``old_logprobs_BR`` and ``sum_pi_squared_BR`` are
    required, ``rollout_is_weights_BR`` optional; ``norm_adv_by_std``, ``gamma``, ``lam`` unused."""
    return _otb(inputs, compact=False, zero_tail=False)


@register_adv_estimator("tir_optimal_token_baseline", uses=USES, groups=True)
def compute_tir_otb_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BR, returns_BR): as optimal_token_baseline, tokens lined up by rank among each row's
    policy tokens, rows without policy tokens outside the groups, and the zero tail (module docstring)."""
    return _otb(inputs, compact=True, zero_tail=True)
