"""ReferenceRole: the frozen initial policy (for the KL loss or the KL penalty in the reward)."""

from __future__ import annotations

from rlsp.data.batch import Batch
from rlsp.workers.context import RoleContext
from rlsp.workers.dispatch import Dispatch, register
from rlsp.workers.roles.actor import build_policy_engine
from rlsp.workers.roles.common import batch_temperature, token_budget


class ReferenceRole:
    def __init__(self, ctx: RoleContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        self.engine = build_policy_engine(ctx, trainable=False)

    @register(Dispatch.BY_DP)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        ref = self.cfg.actor_rollout_ref.ref
        lp = self.engine.infer(batch, self.ctx.prompt_len, ref.log_prob_micro_batch_size_per_gpu, "logprobs",
                               token_budget(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu),
                               temperature=batch_temperature(batch, self.cfg))
        return Batch.from_dict({"ref_logprobs": lp})

    @register(Dispatch.BY_DP)
    def sp_self_check(self, batch: Batch) -> float:
        """Max |logprob(sharded) - logprob(unsharded)| of the reference on `batch` (collective); run when
        its layout differs from the actor's."""
        return self.engine.sp_self_check(batch, self.ctx.prompt_len, "logprobs",
                                         temperature=batch_temperature(batch, self.cfg))
