"""TeacherRole: the frozen teachers of on-policy distillation (`distillation.*`), served like the reference.

Each teacher is a causal LM sharded with FSDP2 over the policy workers in the reference model's layout
(its Ulysses degree included) and run through the same packed forward as the reference: it returns the
teacher's log-probability of every response token the student sampled (`teacher_logprobs`, [B, R]),
at the temperature the rows were sampled with (as the reference's). Several teachers are routed by a
row field (`distillation.teacher_key`, data_source): each row gets the logprobs of the teacher whose
`key` it carries; one teacher without a key scores every row.

Every rank of a dp group must run the same micro-batches (FSDP gathers are collective), so a teacher
scores every row of the shard it is called on and the rows are picked afterwards; the driver calls it
only with the teachers some row of the whole batch routes to. Their logprobs stay here: the distillation
term is added to the advantages on the same workers (`apply_distillation`, rlsp.workers.stage_distill).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlsp.config.run_spec import TeacherSpec
from rlsp.data.batch import Batch
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.models.loading import load_causal_lm
from rlsp.models.vision_lm import build_logprob_model
from rlsp.utils.dtypes import resolve_dtype
from rlsp.workers.columns import POLICY_INPUTS, ROW_FIELDS
from rlsp.workers.context import RoleContext
from rlsp.workers.dispatch import Dispatch, register
from rlsp.workers.roles.common import batch_temperature, fsdp_offload, token_budget
from rlsp.workers.stage_distill import DISTILL_READS, DISTILL_REPORTS, DISTILL_WRITES, DistillRequest, run_distill_stage


def build_teacher_engine(ctx: RoleContext, spec: TeacherSpec) -> FSDPEngine:
    """One frozen teacher on this rank: loaded in its compute dtype, in the reference's layout and offload."""
    arr = ctx.cfg.actor_rollout_ref
    compute = resolve_dtype(spec.dtype)
    lm = load_causal_lm(spec.model_path, dtype=compute)
    module = build_logprob_model(lm.to(ctx.device), chunk_size=arr.actor.logprob_chunk_size)
    return FSDPEngine(module, ctx.dims("ref"), ctx.device, compute_dtype=compute,
                      param_offload=fsdp_offload(arr.ref.fsdp_config, "ref", ctx.device))


def route_rows(sources: Sequence[str], specs: Sequence[TeacherSpec]) -> list[str]:
    """The teacher name of each row: the one whose key equals the row's field (a keyless teacher: all)."""
    if len(specs) == 1 and specs[0].key is None:
        return [specs[0].name] * len(sources)
    by_key = {s.key: s.name for s in specs}
    missing = sorted({src for src in sources if src not in by_key})
    if missing:
        raise ValueError(f"rows with teacher key(s) {missing} match no distillation teacher; teacher keys: "
                         f"{sorted(k for k in by_key if k is not None)}")
    return [by_key[src] for src in sources]


class TeacherRole:
    def __init__(self, ctx: RoleContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        self.specs = ctx.spec.teachers
        self.engines = {spec.name: build_teacher_engine(ctx, spec) for spec in self.specs}

    def _routes(self, batch: Batch) -> list[str]:
        return route_rows(batch.meta[self.cfg.distillation.teacher_key], self.specs)

    @register(Dispatch.BY_DP, reads=(*POLICY_INPUTS, *ROW_FIELDS), writes=("teacher_logprobs",))
    def compute_teacher_log_prob(self, batch: Batch, names: list[str]) -> Batch:
        """`teacher_logprobs` [B, R] of the shard's rows, each from its routed teacher; `names`: the teachers
        the whole batch routes to (the same list on every rank, so every rank runs the same forwards)."""
        ref, routes = self.cfg.actor_rollout_ref.ref, self._routes(batch)
        out_BR = torch.zeros(len(batch), batch["input_ids"].shape[1] - self.ctx.prompt_len)
        for name in names:
            lp_BR = self.engines[name].infer(
                batch, self.ctx.prompt_len, ref.log_prob_micro_batch_size_per_gpu, "logprobs",
                token_budget(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu),
                temperature=batch_temperature(batch, self.cfg))
            rows_B = torch.tensor([r == name for r in routes], dtype=torch.bool)
            out_BR[rows_B] = lp_BR[rows_B].to(out_BR.dtype)
        return Batch.from_dict({"teacher_logprobs": out_BR})

    @register(Dispatch.BY_DP, reads=DISTILL_READS, writes=DISTILL_WRITES, reports=DISTILL_REPORTS)
    def apply_distillation(self, batch: Batch, request: DistillRequest) -> Batch:
        """advantages = A_task - coef * d (or -d) on this shard's rows, with the per-row values of the
        distillation metrics (rlsp.workers.stage_distill); no model pass."""
        return run_distill_stage(batch, request)

    @register(Dispatch.BY_DP, reads=(*POLICY_INPUTS, *ROW_FIELDS))
    def sp_self_check(self, batch: Batch) -> float:
        """Max |logprob(sharded) - logprob(unsharded)| over the teachers on `batch` (collective)."""
        return max(engine.sp_self_check(batch, self.ctx.prompt_len, "logprobs",
                                        temperature=batch_temperature(batch, self.cfg))
                   for engine in self.engines.values())
