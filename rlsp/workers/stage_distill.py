"""On-policy distillation's term on the policy workers: advantages = A_task - coef * d (or -d) on a dp shard.

After the teachers' logprobs (`TeacherRole.compute_teacher_log_prob`, a worker column) the driver calls
`TeacherRole.apply_distillation` (Dispatch.BY_DP) with a `DistillRequest`. Each dp group gets a shard of the
step's rows and computes, from its rows alone (rlsp.algos.distillation):

- d, the per-token divergence of the student's logprobs (`old_logprobs`, the behaviour policy) from the
  teacher's, and the advantages with the term, which replace the step's advantages in the worker's column
  (the task advantages come from the workers' stage, or, for the outcome estimators the driver computes
  per row, as a row broadcast: one number per row, expanded here to value * response_mask);
- the per-row statistics of the distillation metrics (`ROW_STATS`: sums over the row's tokens, the row's
  extremes of d, its token count) and the row's advantage sum, which the driver receives instead of the rows:
  it adds them up over the rows (rlsp.algos.distillation.distillation_metrics_from_rows), the numbers of the
  whole-batch computation. Nothing is batch-wide here, so no collective runs, and the driver's traffic per
  row does not grow with the response length.

Shape legend: B rows of this shard, R response length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlsp.algos.aggregation import masked_sum
from rlsp.algos.distillation import (
    ROW_STATS,
    compute_distillation_advantages,
    compute_distillation_losses,
    distillation_row_stats,
)
from rlsp.data.batch import Batch

DISTILL_READS = ("response_mask", "old_logprobs", "teacher_logprobs", "advantages")
# Per row: the metrics' statistics and the sum of the new advantages over the row's tokens (the driver's
# advantages/mean, as the step stage reports it).
DISTILL_REPORTS = (*ROW_STATS, "advantages_sum")
DISTILL_WRITES = ("advantages", *DISTILL_REPORTS)


@dataclass(frozen=True)
class DistillRequest:
    """distillation.distillation_loss.*: the estimate of d (`loss_mode`, one of rlsp.algos.kl's; checked at
    start-up, rlsp.config.validate_distill), its clamps, and how it joins the task advantage (A_task - coef * d
    with `use_task_rewards`, else -d)."""

    loss_mode: str = "k1"
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    use_task_rewards: bool = True
    coef: float = 1.0

    @classmethod
    def from_config(cls, loss: Any) -> DistillRequest:
        """The request of `distillation.distillation_loss`."""
        return cls(str(loss.loss_mode), loss.loss_max_clamp, loss.log_prob_min_clamp, bool(loss.use_task_rewards),
                   float(loss.distillation_loss_coef))


def run_distill_stage(rows: Batch, request: DistillRequest) -> Batch:
    """The advantages with the distillation term of `rows` and their per-row reports (`DISTILL_WRITES`)."""
    mask_BR = rows["response_mask"]
    student_BR, teacher_BR = rows["old_logprobs"], rows["teacher_logprobs"]
    d_BR = compute_distillation_losses(student_BR, teacher_BR, mask_BR, loss_mode=request.loss_mode,
                                       loss_max_clamp=request.loss_max_clamp,
                                       log_prob_min_clamp=request.log_prob_min_clamp)
    if request.use_task_rewards and "advantages" not in rows:
        raise RuntimeError("distillation with use_task_rewards=true needs the step's task advantages in its rows (they "
                           f"have {sorted(rows.keys())}): compute the advantages before the distillation term")
    task_BR = rows["advantages"] if request.use_task_rewards else None
    adv_BR = compute_distillation_advantages(task_BR, d_BR, mask_BR, use_task_rewards=request.use_task_rewards,
                                             coef=request.coef)
    out = {"advantages": adv_BR, "advantages_sum": masked_sum(adv_BR, mask_BR, dim=-1)}
    out.update(distillation_row_stats(student_BR, teacher_BR, d_BR, mask_BR))
    return Batch.from_dict(out)
