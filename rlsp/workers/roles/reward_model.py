"""RewardModelRole: a frozen sequence-classification model that scores every response (reward_model.enable).

Sharded like the reference (FSDP2 over the policy workers, Ulysses with
`reward_model.ulysses_sequence_parallel_size`, fsdp_size and offload from
`reward_model.model.fsdp_config`) and run through the same packed engine path: its head
(rlsp.models.reward.RewardModel) returns a score per token and the sequence's score is the one at
its last real token. Each sample is scored in the reward model's own chat format when its tokenizer
differs from `reward_model.model.input_tokenizer` (the policy's): see rlsp.data.rm_inputs. The score
lands on the last response token (`rm_scores`, [B, R]), which the driver uses as the token-level
score (verl's rule, rlsp.rewards.scoring.apply_rm_scores). With reward_model.use_reward_loop the role
hosts verl's reward loop instead (a vLLM pooling engine, rlsp.workers.roles.reward_loop); the scores
land the same way.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from rlsp.data.batch import Batch, last_policy_token
from rlsp.data.rm_inputs import render_for_reward_model, same_tokenizer
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.models.reward import RewardModel, load_reward_model
from rlsp.utils.dtypes import resolve_dtype
from rlsp.workers.columns import MODEL_INPUTS, ROW_FIELDS
from rlsp.workers.context import RoleContext
from rlsp.workers.dispatch import Dispatch, register
from rlsp.workers.roles.common import fsdp_offload, token_budget
from rlsp.workers.roles.reward_loop import RewardLoopScorer


def build_reward_engine(ctx: RoleContext) -> FSDPEngine:
    """The reward model on this rank: frozen, in the policy's compute dtype (model.dtype)."""
    rm = ctx.cfg.reward_model
    compute = resolve_dtype(ctx.cfg.actor_rollout_ref.model.dtype)
    module = RewardModel(load_reward_model(rm.model.path, dtype=compute).to(ctx.device))
    return FSDPEngine(module, ctx.dims("reward_model"), ctx.device, compute_dtype=compute,
                      param_offload=fsdp_offload(rm.model.fsdp_config, "reward_model", ctx.device))


def place_on_last_token(scores_B: torch.Tensor, response_mask_BR: torch.Tensor) -> torch.Tensor:
    """[B, R] zeros with each row's score on its last policy token (none for an empty response)."""
    out_BR = torch.zeros_like(response_mask_BR, dtype=torch.float32)
    last_B = last_policy_token(response_mask_BR)
    out_BR[torch.arange(len(scores_B)), last_B] = scores_B.float()
    return out_BR * response_mask_BR


class RewardModelRole:
    def __init__(self, ctx: RoleContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        rm = ctx.cfg.reward_model
        # verl's reward loop: a vLLM pooling engine instead of the FSDP model (rlsp.workers.roles.reward_loop).
        self.loop = RewardLoopScorer(ctx.cfg, tp=ctx.layout.role("reward_model").tp) if rm.use_reward_loop else None
        if self.loop is not None:
            return
        self.engine = build_reward_engine(ctx)
        self.tokenizer = AutoTokenizer.from_pretrained(rm.model.path)
        source = rm.model.input_tokenizer
        self.input_tokenizer = AutoTokenizer.from_pretrained(source) if source else None
        # Re-render only when the formats differ (null: the ids are fed as they are; preflight checked
        # that the tokenizers then match).
        self.rerender = self.input_tokenizer is not None and not same_tokenizer(self.input_tokenizer, self.tokenizer)
        self.max_len = getattr(self.engine.config, "max_position_embeddings", None)

    def rows(self, batch: Batch) -> Batch:
        """The reward model's input rows for `batch` (the rollout rows, or re-rendered ones)."""
        if self.rerender:
            return render_for_reward_model(batch, self.ctx.prompt_len, self.input_tokenizer, self.tokenizer,
                                           self.max_len)
        return Batch.from_dict({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})

    @register(Dispatch.BY_DP, reads=(*MODEL_INPUTS, *ROW_FIELDS), writes=("rm_scores",),
              reports=("rm_score", "rm_row_reward"))
    def compute_rm_score(self, batch: Batch) -> Batch:
        """`rm_scores` [B, R]: each sequence's score on its last response token (zeros elsewhere)."""
        rm = self.cfg.reward_model
        if self.loop is not None:
            scores_B = torch.tensor(self.loop.scores(batch), dtype=torch.float32)
            return Batch.from_dict({"rm_scores": place_on_last_token(scores_B, batch["response_mask"])})
        rows = self.rows(batch)
        scores_B = self.engine.infer(rows, rows["input_ids"].shape[1], rm.micro_batch_size_per_gpu, "scores",
                                     token_budget(rm.use_dynamic_bsz, rm.forward_max_token_len_per_gpu),
                                     last_token=True)
        return Batch.from_dict({"rm_scores": place_on_last_token(scores_B, batch["response_mask"])})

    @register(Dispatch.BY_DP, reads=(*MODEL_INPUTS, *ROW_FIELDS))
    def sp_self_check(self, batch: Batch) -> float:
        """Max |score(ulysses=k) - score(unsharded)| over the rows of `batch` (collective)."""
        rows = self.rows(batch)
        return self.engine.sp_self_check(rows, rows["input_ids"].shape[1], "scores", last_token=True)
