"""CriticRole: the value model (backbone + scalar head, FSDP2, fp32 master weights) — values and updates.

The backbone is initialised from `critic.model.path`, or from the actor's checkpoint when unset; the
value head is new (seeded normal init, zero bias). A vision-language model (rlsp.models.critic_vision) loads with its
vision tower and reads the rows' images as the policy does (rlsp.models.value.VisionValueModel); a text critic is
given the rows without their images.
"""

from __future__ import annotations

import os

import torch

from rlsp.data.batch import Batch
from rlsp.engine.checkpoint import load_engine, save_engine
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.models.critic_vision import critic_model_path, critic_vision_tower
from rlsp.models.loading import load_backbone
from rlsp.models.rms_norm import apply_lean_rmsnorm
from rlsp.models.tiled_mlp import apply_tiled_mlp
from rlsp.models.value import VisionValueModel, build_value_model
from rlsp.models.vision_inputs import MM_KEY
from rlsp.utils.dtypes import resolve_dtype
from rlsp.workers.columns import POLICY_INPUTS
from rlsp.workers.context import RoleContext
from rlsp.workers.critic_loss import make_critic_loss
from rlsp.workers.dispatch import Dispatch, register
from rlsp.workers.ppo_loop import global_counts, run_ppo_epochs
from rlsp.workers.roles.common import fsdp_offload, log, note_padding, optim_settings, role_metrics, token_budget


def build_critic_engine(ctx: RoleContext) -> FSDPEngine:
    c = ctx.cfg.critic
    note_padding("critic.model", c.model.use_remove_padding, "values")
    compute = resolve_dtype(c.model.dtype or ctx.cfg.actor_rollout_ref.model.dtype)
    tower = critic_vision_tower(ctx.cfg)  # a vision-language critic: its tower too (the rows' images)
    backbone = load_backbone(critic_model_path(ctx.cfg), dtype=torch.float32, vision_tower=tower)
    if c.model.enable_gradient_checkpointing:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if c.model.tiled_mlp.enabled:  # before TP/FSDP; parameter names stay the same
        apply_tiled_mlp(backbone, c.model.tiled_mlp.num_shards)
    if c.model.lean_rmsnorm:  # before TP/FSDP; the norms keep their weight Parameters and names
        apply_lean_rmsnorm(backbone)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.cfg.trainer.seed)  # the same value head on every rank, whatever ran before
        module = build_value_model(backbone, freeze_vision_tower=c.model.freeze_vision_tower)
    return FSDPEngine(module.to(ctx.device), ctx.dims("critic"), ctx.device, compute_dtype=compute,
                      optim=optim_settings(ctx.cfg, "critic"), activation_offload=c.model.enable_activation_offload,
                      param_offload=fsdp_offload(c.model.fsdp_config, "critic", ctx.device))


class CriticRole:
    def __init__(self, ctx: RoleContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        self.engine = build_critic_engine(ctx)
        self.reads_images = isinstance(self.engine.module, VisionValueModel)
        if not self.reads_images:
            log.info("critic: %s is a text model; rows with images reach it without them (their image "
                     "placeholders are tokens to it)", critic_model_path(self.cfg))

    def _rows(self, batch: Batch) -> Batch:
        """The rows as the critic's model takes them: a text critic's without their images."""
        if self.reads_images or MM_KEY not in batch.meta:
            return batch
        return Batch(batch.tensors, {k: v for k, v in batch.meta.items() if k != MM_KEY}, dict(batch.info))

    @register(Dispatch.BY_DP, reads=POLICY_INPUTS, writes=("values",))
    def compute_values(self, batch: Batch) -> Batch:
        """V(s_t) [B, R] for the state before every response token (zeros on padding)."""
        c = self.cfg.critic
        values = self.engine.infer(self._rows(batch), self.ctx.prompt_len, c.forward_micro_batch_size_per_gpu,
                                   "values", token_budget(c.use_dynamic_bsz, c.forward_max_token_len_per_gpu))
        return Batch.from_dict({"values": values})

    @register(Dispatch.BY_DP, reads=(*POLICY_INPUTS, "values", "returns"))
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss epochs over mini-batches of this dp shard (needs values and returns)."""
        c = self.cfg.critic
        dims = self.engine.dims

        def train_mini(mini: Batch) -> dict[str, float]:
            loss_fn = make_critic_loss(c.cliprange_value, *global_counts(mini, dims.dp_group), c.loss_agg_mode)
            return self.engine.train_step(mini, self.ctx.prompt_len, c.ppo_micro_batch_size_per_gpu, loss_fn,
                                          token_budget(c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu))

        mini_rows = c.ppo_mini_batch_size * self.cfg.actor_rollout_ref.rollout.n // dims.dp_size
        metrics = run_ppo_epochs(self._rows(batch), mini_rows, c.ppo_epochs, c.shuffle, self.cfg.trainer.seed + 1,
                                 dims.dp_rank, train_mini)
        return role_metrics("critic", metrics, drop_prefixes=("sp/",))

    @register(Dispatch.BY_DP, reads=POLICY_INPUTS)
    def sp_self_check(self, batch: Batch) -> float:
        """Max |value(sp=k) - value(unsharded)| on `batch` (collective)."""
        return self.engine.sp_self_check(self._rows(batch), self.ctx.prompt_len, "values")

    @register(Dispatch.ALL)
    def save_checkpoint(self, ckpt_dir: str) -> None:
        save_engine(self.engine, os.path.join(ckpt_dir, "critic"))

    @register(Dispatch.ALL)
    def load_checkpoint(self, ckpt_dir: str) -> None:
        load_engine(self.engine, os.path.join(ckpt_dir, "critic"))

    @register(Dispatch.ALL)
    def param_checksum(self) -> float:
        return sum(float(t.abs().sum()) for _, t in self.engine.iter_full_params(torch.float64))
