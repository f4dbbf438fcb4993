"""Schema of the value model's section (`critic.*`, PPO with algorithm.adv_estimator=gae); verl's key names.

Unset batch keys follow the actor's through interpolations, as in verl. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import II

from rlsp.config import schema_verl_runtime as verl_keys  # verl's engine/runtime keys, mixed into the sections
from rlsp.config.schema_engine import FSDPConfig, OptimConfig, TiledMLPConfig


@dataclass
class CriticModelConfig:
    path: str | None = None  # None = initialise from the actor's checkpoint (actor_rollout_ref.model.path)
    dtype: str | None = None  # compute dtype; None = actor_rollout_ref.model.dtype (master weights stay fp32)
    enable_gradient_checkpointing: Any = "auto"  # as actor_rollout_ref.model.enable_gradient_checkpointing, for the critic
    use_remove_padding: bool = True  # as actor_rollout_ref.model.use_remove_padding, for the values
    enable_activation_offload: bool = False  # as actor_rollout_ref.model.enable_activation_offload, for the critic
    tiled_mlp: TiledMLPConfig = field(default_factory=TiledMLPConfig)
    lean_rmsnorm: bool = False  # as actor_rollout_ref.model.lean_rmsnorm, for the critic
    freeze_vision_tower: bool = False  # a vision-language critic (qwen2_5_vl, qwen3_vl, qwen3_vl_moe; qwen3_5 with images): its vision tower gets no gradient and no optimizer state (rlsp's key: verl's critic has none and trains the tower)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class CriticOptimConfig(OptimConfig):
    lr: float = 1e-5


@dataclass
class CriticConfig(verl_keys.CriticVerlKeys):
    """The value model (PPO with algorithm.adv_estimator=gae). Built only when an estimator needs it."""

    strategy: str = "fsdp2"
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    # Unset batch keys follow the actor's (or the critic's update's) as in verl.
    ppo_mini_batch_size: int = II("actor_rollout_ref.actor.ppo_mini_batch_size")  # prompts per optimizer step (x rollout.n samples), verl semantics
    ppo_micro_batch_size_per_gpu: int = 32  # samples per forward/backward on one worker
    forward_micro_batch_size_per_gpu: int = II(".ppo_micro_batch_size_per_gpu")  # samples per value forward (no grad)
    use_dynamic_bsz: Any = II("actor_rollout_ref.actor.use_dynamic_bsz")  # token-budget micro-batches for the value forward and the update
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = II(".ppo_max_token_len_per_gpu")
    ppo_epochs: int = II("actor_rollout_ref.actor.ppo_epochs")
    shuffle: bool = II("actor_rollout_ref.actor.shuffle")
    cliprange_value: float = 0.5  # clip of the new value around the rollout-time value
    loss_agg_mode: str = II("actor_rollout_ref.actor.loss_agg_mode")  # the value loss's aggregation (verl: the actor's unless set)
    ulysses_sequence_parallel_size: int = 1
    ring_sequence_parallel_size: int = 1
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = True
    sequence_parallel_adaptive: bool = False  # see actor_rollout_ref.actor.sequence_parallel_adaptive
    colocate: bool = True  # share the actor's workers and devices (verl's hybrid layout); False = own pool
    nnodes: int = 1  # own pool only (critic.colocate=false)
    n_gpus_per_node: int = 1  # own pool only: critic worker processes per node
