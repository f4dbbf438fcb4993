"""Distillation's term on data-parallel shards (rlsp.workers.stage_distill) against the whole batch on one process.

Each of two gloo ranks takes its dp group's rows, built as a worker builds them (`assemble`: the task advantages
either as the step stage's [B, R] column or as the driver's row broadcast of an outcome estimator, one number
per row), and runs `run_distill_stage`, what `TeacherRole.apply_distillation` runs. The shards, put together in
row order, are compared with the whole batch, every element:

- the advantages (A_task - coef * d with the task advantages, -d alone without) bit for bit with
  `compute_distillation_advantages` of `compute_distillation_losses`: both are per token;
- the metrics the driver builds from the reported per-row values (`distillation_metrics_from_rows`) bit for bit
  with `distillation_metrics` of the whole batch, and within fp64 roundoff of an independent whole-batch
  computation (masked means over every token at once, tests/tolerances.py derivation 1);
- the advantages' row sums the driver's advantages/mean reads.

Masks have holes, one row has no response token; d is clamped and floored so the clamps are exercised.
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from tolerances import roundoff_rtol, scalar_tol

from rlsp.algos.aggregation import masked_sum
from rlsp.algos.distillation import (
    ROW_STATS,
    compute_distillation_advantages,
    compute_distillation_losses,
    distillation_metrics,
    distillation_metrics_from_rows,
)
from rlsp.data.batch import Batch
from rlsp.workers.columns import ROW_SUFFIX, RowsSpec, assemble
from rlsp.workers.stage_distill import DISTILL_READS, DISTILL_WRITES, DistillRequest, run_distill_stage

pytestmark = pytest.mark.distributed

B, R = 8, 11
REQUESTS = {
    "k1+task": DistillRequest("k1", loss_max_clamp=1.5, log_prob_min_clamp=-6.0, use_task_rewards=True, coef=0.7),
    "k3 alone": DistillRequest("k3", use_task_rewards=False),
}


def _columns() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    mask = (torch.rand(B, R, generator=gen) > 0.25).float()
    mask[:, 0] = 1
    mask[:, R - 2:] = 0
    mask[5] = 0  # no response token
    student = -torch.rand(B, R, generator=gen) * 4
    teacher = -torch.rand(B, R, generator=gen) * 8  # some below the floor of -6
    return {"response_mask": mask, "old_logprobs": student, "teacher_logprobs": teacher,
            "advantages": torch.randn(B, R, generator=gen) * mask, "row_advantage": torch.randn(B, generator=gen)}


def _shard_rows(cols: dict[str, torch.Tensor], rows: slice, row_broadcast: bool) -> Batch:
    """The shard as the worker assembles it: the step stage's advantages column, or the row broadcast."""
    by_value = {k: cols[k][rows] for k in DISTILL_READS if k != "advantages"}
    if row_broadcast:
        by_value["advantages" + ROW_SUFFIX] = cols["row_advantage"][rows]
    else:
        by_value["advantages"] = cols["advantages"][rows]
    n = by_value["response_mask"].shape[0]
    return assemble(RowsSpec(n, [], Batch.from_dict(by_value)), [])


def _distill_worker(rank: int, world: int) -> dict[tuple[str, bool], dict[str, torch.Tensor]]:
    dims = layout_dims()
    per = B // dims.dp_size
    rows = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
    out = {}
    for name, request in REQUESTS.items():
        for row_broadcast in (False, True):
            result = run_distill_stage(_shard_rows(_columns(), rows, row_broadcast), request)
            assert set(result.keys()) == set(DISTILL_WRITES), sorted(result.keys())
            out[name, row_broadcast] = {k: result[k] for k in result.keys()}
    return out


def _fp64_metrics(cols: dict[str, torch.Tensor], d: torch.Tensor) -> dict[str, float]:
    """The metrics over every response token of the whole batch at once, in fp64."""
    on = cols["response_mask"].bool()
    s, q = cols["old_logprobs"].double()[on], cols["teacher_logprobs"].double()[on]
    d_on = d.double()[on]
    return {"distillation/reverse_kl": float((s - q).mean()), "distillation/loss": float(d_on.mean()),
            "distillation/abs_loss": float(d_on.abs().mean()), "distillation/loss_min": float(d_on.min()),
            "distillation/loss_max": float(d_on.max()), "distillation/teacher_logprob_mean": float(q.mean())}


def test_distillation_term_on_dp_shards_equals_the_whole_batch():
    results = run_distributed(_distill_worker, 2)
    cols = _columns()
    mask = cols["response_mask"]
    tokens = int(mask.sum())
    for (name, row_broadcast), first in results[0].items():
        got = {k: torch.cat([r[name, row_broadcast][k] for r in results]) for k in first}
        request = REQUESTS[name]
        task = cols["row_advantage"].unsqueeze(-1) * mask if row_broadcast else cols["advantages"]
        d = compute_distillation_losses(cols["old_logprobs"], cols["teacher_logprobs"], mask, loss_mode=request.loss_mode,
                                        loss_max_clamp=request.loss_max_clamp,
                                        log_prob_min_clamp=request.log_prob_min_clamp)
        want = compute_distillation_advantages(task, d, mask, use_task_rewards=request.use_task_rewards,
                                               coef=request.coef)
        assert torch.equal(got["advantages"], want), (name, row_broadcast)
        assert torch.equal(got["advantages_sum"], masked_sum(want, mask, dim=-1)), (name, row_broadcast)
        metrics = distillation_metrics_from_rows({k: got[k] for k in ROW_STATS})
        assert metrics == distillation_metrics(cols["old_logprobs"], cols["teacher_logprobs"], d, mask), name
        rtol = roundoff_rtol(reduction=tokens, stages=1, dtype=torch.float64)  # one sum over the tokens, reordered
        for key, value in _fp64_metrics(cols, d).items():
            scale = float(cols["teacher_logprobs"].abs().max() + cols["old_logprobs"].abs().max())
            assert abs(metrics[key] - value) <= scalar_tol(scale, rtol), (name, key, metrics[key], value)
        if request.loss_max_clamp is not None:  # the clamp and the floor act on these rows
            assert metrics["distillation/loss_max"] == request.loss_max_clamp
            assert float(cols["teacher_logprobs"][mask.bool()].min()) < request.log_prob_min_clamp
