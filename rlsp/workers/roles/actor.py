"""ActorRole: the trainable policy (FSDP2, fp32 master weights) — logprobs, PPO updates, checkpoints."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from rlsp.algos.rollout_correction import RolloutCorrection
from rlsp.config.lora_keys import lora_enabled
from rlsp.data.batch import Batch
from rlsp.data.vision_processor import PROCESSOR_FILES
from rlsp.data.vision_run import policy_vision_tower
from rlsp.engine.checkpoint import load_engine, save_engine
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.router_aux import aux_loss_coef, with_overrides
from rlsp.engine.router_replay import ROUTES_KEY, replay_mode
from rlsp.models.loading import load_causal_lm
from rlsp.models.lora import LORA_ADAPTER_DIR, LoraAdapters, LoraSettings, apply_lora
from rlsp.models.rms_norm import apply_lean_rmsnorm
from rlsp.models.tiled_mlp import apply_tiled_mlp
from rlsp.models.vision_lm import build_logprob_model
from rlsp.models.vision_lora import language_model, note_frozen_tower
from rlsp.utils.dtypes import resolve_dtype
from rlsp.workers.actor_loss import ActorLossConfig, make_actor_loss
from rlsp.workers.columns import POLICY_INPUTS
from rlsp.workers.context import RoleContext
from rlsp.workers.dispatch import Dispatch, register
from rlsp.workers.ppo_loop import global_counts, run_ppo_epochs
from rlsp.workers.roles.common import (
    batch_temperature,
    fsdp_offload,
    note_padding,
    optim_settings,
    role_metrics,
    token_budget,
    torch_compile_enabled,
)
from rlsp.workers.stage_correction import CORRECTION_READS, CORRECTION_REPORTS, CORRECTION_WRITES, run_correction
from rlsp.workers.step_stage import STAGE_READS, STAGE_REPORTS, STAGE_WRITES, StageRequest, dp_sum, run_step_stage


def lora_settings(model: Any) -> LoraSettings | None:
    """The LoRA adapters `actor_rollout_ref.model` asks for, or None (full fine-tuning)."""
    if not lora_enabled(model):
        return None
    def names(v: Any) -> Any:
        return v if v is None or isinstance(v, str) else tuple(v)
    return LoraSettings(rank=int(model.lora_rank), alpha=float(model.lora_alpha), target_modules=names(model.target_modules),
                        exclude_modules=names(model.exclude_modules), adapter_path=model.lora_adapter_path)


def build_policy_engine(ctx: RoleContext, trainable: bool,
                        lora: LoraSettings | None = None) -> tuple[FSDPEngine, LoraAdapters | None]:
    """The policy model on this rank: fp32 master weights when trainable, compute dtype from model.dtype.
    With `lora` only the adapters are trainable (fp32 masters); the frozen base stays in the compute dtype."""
    arr = ctx.cfg.actor_rollout_ref
    note_padding("actor_rollout_ref.model", arr.model.use_remove_padding, "logprobs and entropy")
    compute = resolve_dtype(arr.model.dtype)
    lm = load_causal_lm(arr.model.path, dtype=torch.float32 if trainable and lora is None else compute,
                        vision_tower=policy_vision_tower(ctx.cfg))  # a Qwen3.5 wrapper with image rows: its tower too
    if trainable and arr.model.enable_gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if arr.model.tiled_mlp.enabled:  # before TP/FSDP; parameter names stay the same; a VLM's language model only
        apply_tiled_mlp(language_model(lm), arr.model.tiled_mlp.num_shards)
    if arr.model.lean_rmsnorm:  # before TP/FSDP; the norms keep their weight Parameters and names (not the tower's)
        apply_lean_rmsnorm(language_model(lm))
    adapters = apply_lora(lm, lora) if trainable and lora is not None else None  # after tiling: peft wraps the linears in place
    if adapters is not None:
        note_frozen_tower(lm, arr.actor.freeze_vision_tower)
    role = "actor" if trainable else "ref"
    setting = arr.ref.use_torch_compile if role == "ref" and arr.ref.use_torch_compile is not None \
        else arr.actor.use_torch_compile
    compiled = torch_compile_enabled(setting, ctx.device, role)
    module = build_logprob_model(lm.to(ctx.device), chunk_size=arr.actor.logprob_chunk_size, compiled=compiled,
                                 freeze_vision_tower=arr.actor.freeze_vision_tower)  # VL: the vision tower's head model
    optim = optim_settings(ctx.cfg, "actor") if trainable else None
    engine = FSDPEngine(module, ctx.dims(role), ctx.device,
                        compute_dtype=compute, optim=optim,
                        activation_offload=trainable and arr.model.enable_activation_offload,
                        param_offload=fsdp_offload(arr[role].fsdp_config, role, ctx.device),
                        router_replay=trainable and replay_mode(arr) in ("R2", "R3"),
                        # the MoE router auxiliary loss config.json or verl's model.override_config asks for
                        router_aux_coef=aux_loss_coef(with_overrides(lm.config, arr.model.override_config))
                        if trainable else 0.0)
    return engine, adapters


class ActorRole:
    def __init__(self, ctx: RoleContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        self.engine, self.lora = build_policy_engine(ctx, trainable=True, lora=lora_settings(ctx.cfg.actor_rollout_ref.model))

    def rollout_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under the rollout engine's (base) names, one at a time (collective); with LoRA the
        adapters are merged in (W + scale * B @ A)."""
        if self.lora is None:
            return self.engine.iter_full_params(dtype)
        return ((name, t.to(dtype)) for name, t in self.lora.merge_for_rollout(self.engine.iter_full_params()))

    def base_model(self) -> contextlib.AbstractContextManager[None]:
        """The reference policy in this engine: the base with the adapters switched off (LoRA only)."""
        if self.lora is None:
            raise RuntimeError("the actor's base model is the reference only with LoRA (actor_rollout_ref.model.lora_rank > 0)")
        return self.lora.adapters_disabled()

    @register(Dispatch.ALL)
    def export_rollout_weights(self, dtype: str) -> list[tuple[str, torch.Tensor]] | None:
        """Full weights for a rollout pool of its own (collective): rank 0 returns them on the CPU, others None."""
        named = [(name, t.detach().to("cpu", copy=True)) for name, t in self.rollout_weights(resolve_dtype(dtype))]
        return named if self.ctx.rank == 0 else None

    @register(Dispatch.BY_DP, reads=(*POLICY_INPUTS, "rollout_logprobs", ROUTES_KEY),
              writes=("old_logprobs", "sum_pi_squared", ROUTES_KEY),
              reports=("logprob_diff_sum", "logprob_diff_max"))
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Old logprobs [B, R] of the sampled tokens under the current policy; with actor.calculate_sum_pi_squared
        also sum_pi_squared [B, R] (sum over the vocabulary of p^2 per token, from the same forward); with
        actor.router_replay.mode=R2 the MoE routes [B, P+R, L, K] the update replays (rlsp.engine.router_replay); with R3
        the rows carry the rollout's routes: this pass replays them and the update replays them again."""
        r = self.cfg.actor_rollout_ref.rollout
        head = {"with_sum_pi_squared": True} if self.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared else {}
        self.engine.expert_load.reset()  # counts of a step without an actor update (critic warmup) end here
        out = self.engine.infer_many(batch, self.ctx.prompt_len, r.log_prob_micro_batch_size_per_gpu,
                                     ("logprobs", "sum_pi_squared") if head else ("logprobs",),
                                     token_budget(r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu),
                                     temperature=batch_temperature(batch, self.cfg),
                                     record_routes=replay_mode(self.cfg.actor_rollout_ref) == "R2",
                                     replay_routes=replay_mode(self.cfg.actor_rollout_ref) == "R3", **head)
        out["old_logprobs"] = out.pop("logprobs")
        return Batch.from_dict(out)

    @register(Dispatch.BY_DP, reads=STAGE_READS, writes=STAGE_WRITES, reports=STAGE_REPORTS)
    def compute_advantages(self, batch: Batch, request: StageRequest) -> Batch:
        """Token rewards (KL in the reward) and advantages of this dp shard, batch-wide sums all-reduced over
        the dp group (rlsp.workers.step_stage); no model pass."""
        dims = self.engine.dims
        return run_step_stage(batch, request, dp_sum(dims.dp_group) if dims.dp_size > 1 else None)

    @register(Dispatch.BY_DP, reads=CORRECTION_READS, writes=CORRECTION_WRITES, reports=CORRECTION_REPORTS)
    def compute_rollout_correction(self, batch: Batch, settings: RolloutCorrection) -> Batch:
        """Rollout-correction weights and the actor's mask of this dp shard, the normalisation's batch-wide sum
        all-reduced over the dp group (rlsp.workers.stage_correction); no model pass."""
        dims = self.engine.dims
        return run_correction(batch, settings, dp_sum(dims.dp_group) if dims.dp_size > 1 else None)

    @register(Dispatch.BY_DP, reads=(*POLICY_INPUTS, "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs",
                                     "rollout_is_weights", ROUTES_KEY))
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over mini-batches of this dp shard; metrics averaged over optimizer steps."""
        a = self.cfg.actor_rollout_ref.actor
        dims = self.engine.dims
        loss_cfg = self._loss_config()
        temperature = batch_temperature(batch, self.cfg)

        def train_mini(mini: Batch) -> dict[str, float]:
            loss_fn = make_actor_loss(loss_cfg, *global_counts(mini, dims.dp_group))
            return self.engine.train_step(mini, self.ctx.prompt_len, a.ppo_micro_batch_size_per_gpu, loss_fn,
                                          token_budget(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu),
                                          temperature=temperature, with_entropy=True)

        mini_rows = a.ppo_mini_batch_size * self.cfg.actor_rollout_ref.rollout.n // dims.dp_size
        metrics = run_ppo_epochs(batch, mini_rows, a.ppo_epochs, a.shuffle, self.cfg.trainer.seed, dims.dp_rank,
                                 train_mini)
        # MoE: tokens per expert of this step's old-logprob and training forwards (collective; {} when dense)
        return role_metrics("actor", {**metrics, **self.engine.expert_load.reduce()})

    def _loss_config(self) -> ActorLossConfig:
        a = self.cfg.actor_rollout_ref.actor
        spec = self.ctx.spec  # policy_loss.loss_mode's loss, or bypass_mode's
        return ActorLossConfig(
            policy_loss=spec.policy_loss, loss_kwargs=dict(spec.policy_loss_kwargs), use_kl_loss=a.use_kl_loss,
            kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, entropy_coeff=a.entropy_coeff, loss_agg_mode=a.loss_agg_mode,
            loss_scale_factor=a.loss_scale_factor,
        )

    @register(Dispatch.BY_DP, reads=POLICY_INPUTS)
    def sp_self_check(self, batch: Batch) -> float:
        """Max |logprob(sp=k) - logprob(unsharded)| on `batch` (collective)."""
        return self.engine.sp_self_check(batch, self.ctx.prompt_len, "logprobs",
                                         temperature=batch_temperature(batch, self.cfg))

    @register(Dispatch.ALL)
    def save_checkpoint(self, ckpt_dir: str) -> None:
        """Sharded model/optimizer/schedule state under <ckpt_dir>/actor, plus what an export needs (collective)."""
        save_engine(self.engine, os.path.join(ckpt_dir, "actor"))
        if self.ctx.rank == 0:
            self._save_hf_assets(os.path.join(ckpt_dir, "actor", "huggingface"))

    @register(Dispatch.ALL)
    def load_checkpoint(self, ckpt_dir: str) -> None:
        load_engine(self.engine, os.path.join(ckpt_dir, "actor"))

    def _save_hf_assets(self, path: str) -> None:
        """Config, tokenizer, generation config and processor files of the model (everything but the weights)."""
        source = self.cfg.actor_rollout_ref.model.path
        self.engine.hf_root.config.save_pretrained(path)  # the whole model's (a vision-language one's, not its text's)
        AutoTokenizer.from_pretrained(source).save_pretrained(path)
        if os.path.exists(os.path.join(source, "generation_config.json")):  # stop ids for generation
            GenerationConfig.from_pretrained(source).save_pretrained(path)
        for name in PROCESSOR_FILES:  # a vision-language model's processor, saved beside it for export
            if os.path.exists(os.path.join(source, name)):
                shutil.copy2(os.path.join(source, name), os.path.join(path, name))
        if self.lora is not None:  # the adapter's config; its weights are in the sharded state
            self.lora.save_config(os.path.join(path, LORA_ADAPTER_DIR), base_model=os.path.abspath(source))

    @register(Dispatch.ALL)
    def param_checksum(self) -> float:
        """Sum of |w| over the full weights (collective): lets tests see that training moved them."""
        return sum(float(t.abs().sum()) for _, t in self.engine.iter_full_params(torch.float64))
