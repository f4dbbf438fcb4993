"""The algorithm between the passes, on the policy workers: the KL penalty in the reward and the
token-level advantage estimators whose batch-wide statistics are sums (GAE, REINFORCE++).

The driver calls `ActorRole.compute_advantages` (Dispatch.BY_DP) with a `StageRequest`. Every dp group
gets a shard of the step's rows (the Ulysses / ring / tp ranks of a group the same shard), and every
rank runs the same rlsp.algos functions on it as the driver would on the whole batch:

- KL in the reward (`compute_kl_penalty`): row by row, so a shard gives the batch's values for its rows;
  each row's token-mean KL is reported, and the driver takes their mean for the adaptive controller
  (the same numbers as the one-process computation, bit for bit);
- the estimator (`compute_advantages`), given a `reduce` that all-reduces a sum over the data-parallel
  group only: the ranks of one dp group hold the same rows, so summing over them would count rows twice.
  GAE's recursion is per row; its whitening, like REINFORCE++'s, needs batch-wide sums (rlsp.algos.whiten).

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

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.aggregation import masked_sum
from rlsp.algos.kl_ctrl import compute_kl_penalty
from rlsp.algos.registry import compute_advantages, estimator_uses
from rlsp.data.batch import Batch
from rlsp.rewards.scoring import place_scores

# Estimators whose whole input is per row or a batch-wide sum: they run on a dp shard.
STAGE_ESTIMATORS = ("gae", "reinforce_plus_plus")
STAGE_READS = ("token_level_scores", "row_reward", "rm_scores", "response_mask", "old_logprobs", "ref_logprobs",
               "values")
# Per-row sums over the row's response tokens (masked) that the driver's metrics read (scores and rewards
# summed over the whole row, as the driver sums them).
ROW_SUMS = ("score_sum", "reward_sum", "advantages_sum", "returns_sum", "values_sum", "returns_sq_sum",
            "residual_sum", "residual_sq_sum")
STAGE_REPORTS = ("reward_kl", *ROW_SUMS)
STAGE_WRITES = ("token_level_rewards", "advantages", "returns", *STAGE_REPORTS)


@dataclass(frozen=True)
class StageRequest:
    """What the workers compute: `estimator` (one of STAGE_ESTIMATORS, or None: the token rewards only) with
    its `settings` (algorithm.*: rlsp.trainer.estimator_inputs.config_settings), and the KL penalty in the
    reward with coefficient `kl_coef` and estimate `kl_kind` (None: no KL in the reward)."""

    estimator: str | None
    settings: dict[str, Any] = field(default_factory=dict)
    kl_coef: float | None = None
    kl_kind: str = "kl"

    def __post_init__(self) -> None:
        if self.estimator is not None and self.estimator not in STAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {self.estimator!r} does not run on the workers' shards (it needs "
                             f"whole groups or the whole batch); estimators that do: {list(STAGE_ESTIMATORS)}")


def dp_sum(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A `reduce` summing over the data-parallel ranks of `group` (None: one dp rank, nothing to sum)."""
    if group is None or dist.get_world_size(group) == 1:
        return None

    def reduce(x: torch.Tensor) -> torch.Tensor:
        total = x.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    return reduce


def token_scores(rows: Batch) -> torch.Tensor:
    """token_level_scores [B, R] of these rows: the driver's own when it changed them (step rewards, overlong
    shaping: sent by value), else built here as the driver builds them when it reads them
    (rlsp.trainer.reward_workers.set_row_scores, rlsp.rewards.scoring.apply_rm_scores): the reward model's
    token scores, or each row's score on its last policy token."""
    if "token_level_scores" in rows:
        return rows["token_level_scores"]
    if "rm_scores" in rows:
        return rows["rm_scores"]
    if "row_reward" in rows:
        return place_scores(rows["row_reward"].tolist(), rows["response_mask"])
    raise RuntimeError(f"the step stage found no scores in its rows (they have {sorted(rows.keys())}): score the "
                       "rows first (token_level_scores, rm_scores or row_reward)")


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


def run_step_stage(rows: Batch, request: StageRequest,
                   reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> Batch:
    """The columns `request` asks for on `rows` (a shard when `reduce` is given; see the module docstring)."""
    mask_BR = rows["response_mask"]
    columns = {"scores": token_scores(rows)}
    out: dict[str, torch.Tensor] = {}
    if request.kl_coef is not None:
        rewards_BR, out["reward_kl"] = compute_kl_penalty(columns["scores"], rows["old_logprobs"], rows["ref_logprobs"],
                                                          mask_BR, request.kl_coef, request.kl_kind)
    else:
        rewards_BR = columns["scores"]
    columns["token_level_rewards"] = rewards_BR
    if request.estimator is not None:
        extra = {"values_BR": rows["values"]} if "values_BR" in estimator_uses(request.estimator) else {}
        if extra:
            columns["values"] = rows["values"]
        inputs = AdvantageInputs(rewards_BR, mask_BR, reduce=reduce, **request.settings, **extra)
        columns["advantages"], columns["returns"] = compute_advantages(request.estimator, inputs)
    out.update({k: v for k, v in columns.items() if k in STAGE_WRITES})
    out.update(row_sums(columns, mask_BR))
    return Batch.from_dict(out)
