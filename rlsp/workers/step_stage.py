"""The algorithm between the passes, on the policy workers: the KL penalty in the reward and every advantage
estimator whose inputs the workers hold.

The driver calls `ActorRole.compute_advantages` (Dispatch.BY_DP) with a `StageRequest`. Every dp group
gets a shard of the step's rows (the Ulysses / ring / tp ranks of a group the same shard), and every
rank runs the same rlsp.algos functions on it as the driver would on the whole batch:

- the token scores (`token_scores`): each row's reward on its last policy token (or the reward model's
  token scores), plus dapo's overlong penalty and the agent loop's step rewards, from the per-row parts
  (rlsp.rewards.token_scores); the driver sends [rows x response] scores only when it built them itself;
- KL in the reward (`compute_kl_penalty`): row by row, so a shard gives the batch's values for its rows;
  each row's token-mean KL is reported, and the driver takes their mean for the adaptive controller
  (the same numbers as the one-process computation, bit for bit);
- the estimator (`compute_advantages`). Statistics within a prompt group (GRPO's mean and std, RLOO's
  leave-one-out mean, the optimal token baselines, ...; `reads_groups`) are local: the driver cuts the
  shards on group boundaries (rlsp.step.stage_advantages.stage_shards), in shards of unequal row counts
  when the groups do not divide evenly over dp. Batch-wide statistics
  (the whitening of GAE, REINFORCE++ and its group-baseline variant and GDPO, GPG's row counts) are sums, taken by
  a `reduce` that all-reduces over the data-parallel group only: the ranks of one dp group hold the same
  rows, so summing over them would count rows twice (rlsp.algos.whiten). GDPO's reward is the reward function's
  named components, which the driver sends as one float per row and component (`COMPONENTS_KEY`).

A shard may have any number of rows, none included (fewer prompt groups than dp groups). Every collective
is a sum of a fixed number of values (the whitening's [sum, count] and its second pass, GPG's two counts), so
every dp rank enters the same all-reduces with the same shapes; an empty shard's columns keep their dtypes
(rlsp.controller.step_data.StepData.spec), so the sums' dtypes match too, and it adds zeros.

The advantages, returns and token rewards stay here as block columns (the updates read them worker to
worker); the driver receives per-row values only (`STAGE_REPORTS`: the row's KL and the row sums its
metrics need), so its traffic per row does not grow with the response length.

Shape legend: B rows of this shard, R response length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlsp.algos.adv_columns import build_advantage_inputs
from rlsp.algos.aggregation import masked_sum
from rlsp.algos.kl_ctrl import compute_kl_penalty
from rlsp.algos.registry import compute_advantages, estimator_uses
from rlsp.data.batch import Batch
from rlsp.rewards.token_scores import shaped_token_scores

# gdpo's named reward components: one float per row and component, [B, K] in the order of the request's
# `components` (the driver takes them from the reward function's per-row dicts: rlsp.step.estimator_inputs).
COMPONENTS_KEY = "reward_components"
STAGE_READS = ("token_level_scores", "row_reward", "rm_scores", "overlong_reward", "step_rewards", "response_mask",
               "old_logprobs", "ref_logprobs", "values", "reward_baselines", "sum_pi_squared", COMPONENTS_KEY, "rollout_is_weights",
               "uid")
# Per-row sums over the row's response tokens (masked) that the driver's metrics read (scores and rewards
# summed over the whole row, as the driver sums them).
ROW_SUMS = ("score_sum", "reward_sum", "advantages_sum", "returns_sum", "values_sum", "returns_sq_sum",
            "residual_sum", "residual_sq_sum")
STAGE_REPORTS = ("reward_kl", *ROW_SUMS)
STAGE_WRITES = ("token_level_rewards", "advantages", "returns", *STAGE_REPORTS)


@dataclass(frozen=True)
class StageRequest:
    """What the workers compute: `estimator` (any registered one, or None: the token rewards only)
    with its `settings` (algorithm.*: rlsp.step.estimator_inputs.config_settings), the KL penalty in
    the reward with coefficient `kl_coef` and estimate `kl_kind` (None: no KL in the reward), and whether
    the scores get the agent loop's `step_rewards` (when the driver has not built them, `token_scores`); gdpo's
    reward `components` name the columns of the rows' `COMPONENTS_KEY`. An estimator that reads groups needs
    shards holding whole groups (the caller's cut); with `rollout_is_weights` the optimal token baselines read
    the rollout-correction weights the correction wrote before the stage (column `rollout_is_weights`)."""

    estimator: str | None
    settings: dict[str, Any] = field(default_factory=dict)
    kl_coef: float | None = None
    kl_kind: str = "kl"
    step_rewards: bool = False  # add the agent loop's step rewards to the scores (multi_turn.use_step_rewards)
    components: tuple[str, ...] = ()  # gdpo: algorithm.gdpo_reward_keys, the columns of COMPONENTS_KEY
    rollout_is_weights: bool = False  # the estimator reads the rollout-correction weights (algorithm.rollout_correction.rollout_is)

    def __post_init__(self) -> None:
        if self.estimator is not None and "reward_components" in estimator_uses(self.estimator) and not self.components:
            raise ValueError(f"advantage estimator {self.estimator!r} reads named reward components: give their names "
                             "(algorithm.gdpo_reward_keys) as the request's components")


def dp_sum(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A `reduce` summing over the data-parallel ranks of `group` (None: one dp rank, nothing to sum)."""
    if group is None or dist.get_world_size(group) == 1:
        return None

    def reduce(x: torch.Tensor) -> torch.Tensor:
        total = x.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    return reduce


def token_scores(rows: Batch, step_rewards: bool = False) -> torch.Tensor:
    """token_level_scores [B, R] of these rows: the driver's own when it built them (sent by value), else built
    here from the per-row parts it keeps, as it builds them when it reads them (rlsp.rewards.token_scores):
    the reward model's token scores or each row's reward on its last policy token, plus the row's overlong
    penalty (`overlong_reward`, dapo's shaping) and, with `step_rewards`, the agent loop's step rewards."""
    if "token_level_scores" in rows:
        return rows["token_level_scores"]
    if "rm_scores" not in rows and "row_reward" not in rows:
        raise RuntimeError(f"the step stage found no scores in its rows (they have {sorted(rows.keys())}): score the "
                           "rows first (token_level_scores, rm_scores or row_reward)")
    if step_rewards and "step_rewards" not in rows:
        raise RuntimeError("the step stage was asked for tool step rewards (multi_turn.use_step_rewards) but its rows "
                           f"have no step_rewards (they have {sorted(rows.keys())})")
    parts = {"row_reward_B": "row_reward", "rm_scores_BR": "rm_scores", "overlong_B": "overlong_reward"}
    given = {arg: rows[key] for arg, key in parts.items() if key in rows}
    return shaped_token_scores(rows["response_mask"], **given,
                               step_rewards_BR=rows["step_rewards"] if step_rewards else None)


def row_sums(columns: dict[str, torch.Tensor], mask_BR: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-row values of `ROW_SUMS` that `columns` allow (values only with a critic)."""
    out = {"score_sum": columns["scores"].sum(-1), "reward_sum": columns["token_level_rewards"].sum(-1)}
    if "advantages" not in columns:
        return out
    ret_BR = columns["returns"].double()
    out.update(advantages_sum=masked_sum(columns["advantages"], mask_BR, dim=-1),
               returns_sum=masked_sum(ret_BR, mask_BR, dim=-1), returns_sq_sum=masked_sum(ret_BR**2, mask_BR, dim=-1))
    if "values" in columns:
        res_BR = ret_BR - columns["values"].double()
        out.update(values_sum=masked_sum(columns["values"], mask_BR, dim=-1),
                   residual_sum=masked_sum(res_BR, mask_BR, dim=-1), residual_sq_sum=masked_sum(res_BR**2, mask_BR, dim=-1))
    return out


def component_inputs(rows: Batch, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """gdpo's reward components of these rows, name -> [B], from the column `COMPONENTS_KEY` [B, K]."""
    if COMPONENTS_KEY not in rows:
        raise RuntimeError(f"the step stage's rows have no {COMPONENTS_KEY!r} (they have {sorted(rows.keys())}): the "
                           "driver sets them from the reward function's per-row dicts before the stage")
    values_BK = rows[COMPONENTS_KEY]
    if values_BK.dim() != 2 or values_BK.shape[1] != len(names):
        raise ValueError(f"{COMPONENTS_KEY} has shape {tuple(values_BK.shape)} for the components {list(names)}: need "
                         f"[rows, {len(names)}]")
    return {name: values_BK[:, k] for k, name in enumerate(names)}


def run_step_stage(rows: Batch, request: StageRequest,
                   reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> Batch:
    """The columns `request` asks for on `rows` (a shard when `reduce` is given; see the module docstring)."""
    mask_BR = rows["response_mask"]
    columns = {"scores": token_scores(rows, request.step_rewards)}
    out: dict[str, torch.Tensor] = {}
    if request.kl_coef is not None:
        rewards_BR, out["reward_kl"] = compute_kl_penalty(columns["scores"], rows["old_logprobs"], rows["ref_logprobs"],
                                                          mask_BR, request.kl_coef, request.kl_kind)
    else:
        rewards_BR = columns["scores"]
    columns["token_level_rewards"] = rewards_BR
    if request.estimator is not None:
        components = component_inputs(rows, request.components) if request.components else None
        inputs = build_advantage_inputs(request.estimator, {k: rows[k] for k in rows.tensors.keys()} | columns,
                                        rows.meta.get("uid"), request.settings, reduce, components,
                                        is_weights=request.rollout_is_weights)  # the correction's column
        if inputs.values_BR is not None:
            columns["values"] = inputs.values_BR
        columns["advantages"], columns["returns"] = compute_advantages(request.estimator, inputs)
    out.update({k: v for k, v in columns.items() if k in STAGE_WRITES})
    out.update(row_sums(columns, mask_BR))
    return Batch.from_dict(out)
