"""Config blocks shared by the roles that hold a model (actor, reference, critic, reward model): FSDP sharding and
offload, optimizer, tiled MLP, fused-kernel options. Re-exported by rlsp/config/schema.py. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TiledMLPConfig:
    enabled: bool = False  # each layer's MLP runs over sequence tiles: its [tokens, intermediate] activations exist one tile at a time; +1 MLP forward per layer in backward; not with tp > 1
    num_shards: int = 4  # tiles per MLP call (>= 1)


@dataclass
class FusedKernelOptions:
    impl_backend: str = "torch"  # torch | triton (verl's); rlsp's logprob/entropy head is its own vocab-chunked torch code for both


@dataclass
class FSDPConfig:
    # Ranks one copy of the weights (and optimizer state) is sharded over. -1 = every rank of the role
    # but its tensor-parallel dimension (FSDP); a divisor of those shards within groups of that many
    # ranks and replicates across groups (HSDP); 1 = every rank holds everything (its tp share) and only
    # gradients are reduced (DDP-like: least communication, fastest for models that fit one device).
    fsdp_size: Any = "auto"  # auto | -1 | ranks per shard group; auto: 1 when the role's training state fits 1/4 of a rank's memory, else -1 (rlsp.config.auto)
    # Offload (verl's keys): FSDP2 keeps parameters, gradients and optimizer state in host memory together
    # (CPUOffloadPolicy; the optimizer step runs on the CPU). Accepted on cpu, where it saves nothing.
    param_offload: bool = False  # true: that policy (the optimizer state follows its parameters, whatever optimizer_offload says)
    optimizer_offload: bool = False  # true needs param_offload=true (FSDP2 cannot offload the state alone); frozen roles: false
    offload_policy: bool = False  # true: the same policy whatever the two above say (verl's FSDP2 switch)
    # Expert parallelism (MoE models; actor, ref, critic): runs of this many consecutive ranks split every MoE layer's
    # experts and dispatch tokens to them by all-to-all (rlsp.parallel.expert_parallel); must divide the role's ranks
    # and every MoE layer's experts; tensor_model_parallel_size=1 and sequence_parallel_adaptive=false with it.
    # verl FSDP-Turbo's fsdp_config.turbo_config.distributed.expert_parallel_size is read as this key.
    expert_parallel_size: Any = 1  # 1 (every expert on every rank, FSDP-sharded) | auto (rlsp.config.auto: 1 unless the training state and gathered experts overflow half a rank's memory, then the smallest fitting divisor; the reward model: 1) | a divisor of both


@dataclass
class OptimConfig:
    optimizer: str = "AdamW"  # a torch.optim class by verl's name: AdamW | Adam | SGD | Adamax | NAdam | RAdam | RMSprop | Adagrad | Adadelta | Adafactor | ASGD
    optimizer_impl: str = "torch.optim"  # the module the class comes from (torch.optim only)
    override_optimizer_config: dict[str, Any] | None = field(default_factory=dict)  # more keyword arguments of the optimizer class (eps, momentum, amsgrad, ...); they win over lr/weight_decay/betas (verl's rule)
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])  # given to the Adam family only (names containing adam), as verl
    lr_warmup_steps: int = -1  # linear learning-rate warm-up over this many training steps; < 0: lr_warmup_steps_ratio decides
    lr_warmup_steps_ratio: float = 0.0  # warm-up over this fraction of trainer.total_training_steps (when lr_warmup_steps < 0)
    lr_scheduler_type: str = "constant"  # constant (warm-up, then lr) | cosine (warm-up from 0, then half a cosine down to min_lr_ratio x lr; verl's)
    min_lr_ratio: float = 0.0  # cosine: the floor of the schedule, a fraction of lr in [0, 1]
    num_cycles: float = 0.5  # cosine: periods over the run after the warm-up (0.5: from lr down to the floor once)
    zero_indexed_step: bool = True  # cosine: steps counted from 0 (verl's default), false: from 1 (torchtitan's)
    warmup_style: str | None = None  # verl's deprecated spelling of lr_scheduler_type (constant | cosine)
    total_training_steps: int = -1  # steps the cosine spans; -1: trainer.total_training_steps (verl fills it the same way)
    grad_clip: float = 1.0  # max global gradient norm; <= 0 disables clipping
    clip_grad: float | None = None  # verl's spelling of grad_clip: mapped onto it when the config is composed
