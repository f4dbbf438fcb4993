"""The rollout correction on the policy workers: importance weights and rejection between the rollout engine's
policy and the trainer's, computed once per step on each data-parallel rank's shard of the rows.

The driver calls `ActorRole.compute_rollout_correction` (Dispatch.BY_DP) with the step's `RolloutCorrection`
(algorithm.rollout_correction.*) after the old logprobs and before the advantages. Every dp group gets a shard
of the rows (its Ulysses / ring / tp ranks the same one) and runs rlsp.algos.rollout_correction.correction_rows
on it: the weights and the rejection are per token or per row, and the one batch-wide statistic (the mean that
`rollout_is_batch_normalize` divides by) is a sum all-reduced over the data-parallel group only (the ranks of a
dp group hold the same rows; rlsp.workers.step_stage.dp_sum).

What stays on the workers, as block columns of the step:
- `rollout_is_weights` [B, R] (with `rollout_is`): the policy loss multiplies its per-token terms by them
  (rlsp.workers.actor_loss), and the optimal token baselines read them in the step stage;
- `ACTOR_MASK` [B, R] (with `rollout_rs`): the response mask without the rejected tokens. The actor's update
  reads it *as* its `response_mask` (the driver aliases it for that one call), so the rejected tokens leave
  the policy loss, the KL and entropy terms and the loss's token counts; advantages, the critic and the
  step's metrics keep the rollout's mask.

What the driver receives: per-row values only (`CORRECTION_REPORTS`: the row's token count, sums, maxima and
flags of `ROW_STATS`), a fixed number per row whatever the response length; `correction_metrics` of them
gives the rollout_corr/* metrics of the whole batch.

Shape legend: B rows of this shard, R response length.
"""

from __future__ import annotations

import torch

from rlsp.algos.rollout_correction import ROW_STATS, RolloutCorrection, correction_rows
from rlsp.algos.whiten import Reduce
from rlsp.data.batch import Batch

ACTOR_MASK = "actor_response_mask"
REPORT_PREFIX = "rollout_corr_"
CORRECTION_READS = ("old_logprobs", "rollout_logprobs", "response_mask")
CORRECTION_REPORTS = tuple(REPORT_PREFIX + name for name in ROW_STATS)
CORRECTION_WRITES = ("rollout_is_weights", ACTOR_MASK, *CORRECTION_REPORTS)


def run_correction(rows: Batch, settings: RolloutCorrection, reduce: Reduce | None) -> Batch:
    """The correction's columns of `rows` (a shard when `reduce` is given; see the module docstring)."""
    if not settings.enabled:
        raise ValueError("the rollout correction was asked for with algorithm.rollout_correction.rollout_is=null and "
                         "rollout_rs=null: set one of them, or do not call it")
    mask_BR = rows["response_mask"]
    weights_BR, actor_mask_BR, stats = correction_rows(rows["old_logprobs"], rows["rollout_logprobs"], mask_BR,
                                                       settings, reduce)
    out: dict[str, torch.Tensor] = {REPORT_PREFIX + name: value for name, value in stats.items()}
    if weights_BR is not None:
        out["rollout_is_weights"] = weights_BR.to(mask_BR.dtype)
    if settings.rollout_rs is not None:
        out[ACTOR_MASK] = actor_mask_BR
    return Batch.from_dict(out)


def reported_stats(reports: Batch) -> dict[str, torch.Tensor]:
    """The per-row values of `ROW_STATS` among the driver's row reports (every row of the step)."""
    return {name: reports[REPORT_PREFIX + name] for name in ROW_STATS if REPORT_PREFIX + name in reports}
