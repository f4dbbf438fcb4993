"""ReferenceRole: the frozen initial policy (for the KL loss or the KL penalty in the reward).

With LoRA on the actor the initial policy is the actor's own base: the role then has no engine of
its own and runs the actor's with the adapters switched off (no second copy of the weights); its own
fsdp_config offload keys then have no effect (said once at start-up), as in verl.
"""

from __future__ import annotations

import contextlib

from rlsp.data.batch import Batch
from rlsp.workers.columns import POLICY_INPUTS
from rlsp.workers.context import RoleContext
from rlsp.workers.dispatch import Dispatch, register
from rlsp.workers.roles.actor import ActorRole, build_policy_engine
from rlsp.workers.roles.common import batch_temperature, note_shared_reference_offload, token_budget


class ReferenceRole:
    def __init__(self, ctx: RoleContext, actor: ActorRole | None = None) -> None:
        """`actor`: the actor on this worker; given one with LoRA adapters, the reference is its base."""
        self.ctx, self.cfg = ctx, ctx.cfg
        self.actor = actor if actor is not None and actor.lora is not None else None
        if self.actor is not None:
            note_shared_reference_offload(self.cfg.actor_rollout_ref.ref.fsdp_config)
        self.engine = self.actor.engine if self.actor is not None else build_policy_engine(ctx, trainable=False)[0]

    def _policy(self) -> contextlib.AbstractContextManager[None]:
        return self.actor.base_model() if self.actor is not None else contextlib.nullcontext()

    @register(Dispatch.BY_DP, reads=POLICY_INPUTS, writes=("ref_logprobs",))
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        ref = self.cfg.actor_rollout_ref.ref
        with self._policy():
            lp = self.engine.infer(batch, self.ctx.prompt_len, ref.log_prob_micro_batch_size_per_gpu, "logprobs",
                                   token_budget(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu),
                                   temperature=batch_temperature(batch, self.cfg))
        return Batch.from_dict({"ref_logprobs": lp})

    @register(Dispatch.BY_DP, reads=POLICY_INPUTS)
    def sp_self_check(self, batch: Batch) -> float:
        """Max |logprob(sharded) - logprob(unsharded)| of the reference on `batch` (collective); run when
        its layout differs from the actor's."""
        with self._policy():
            return self.engine.sp_self_check(batch, self.ctx.prompt_len, "logprobs",
                                             temperature=batch_temperature(batch, self.cfg))
