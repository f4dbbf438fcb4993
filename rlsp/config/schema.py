"""Typed configuration schema (dataclasses); verl-style key names. No torch import here.

Defaults are those a verl user expects for a real model; configs/rlsp.yaml (the demo) overrides
the few that suit the tiny built-in model instead (learning rate, KL and entropy coefficients).

The YAML files under configs/ only hold values; every key a user can set is declared here, so a typo
in an override fails in Hydra with the list of legal keys instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import II

from rlsp.config import schema_verl_runtime as verl_keys  # verl's engine/runtime keys, mixed into the sections
from rlsp.config.schema_critic import CriticConfig
from rlsp.config.schema_distill import DistillationConfig
from rlsp.config.schema_engine import FSDPConfig, FusedKernelOptions, OptimConfig, TiledMLPConfig
from rlsp.config.schema_policy_loss import PolicyLossConfig
from rlsp.config.schema_reward import (
    CustomRewardFunctionConfig,
    FilterGroupsConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelModelConfig,
    RewardModelRolloutConfig,
)
from rlsp.config.schema_rollout import (
    AsyncTrainingConfig,
    MultiTurnConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    RolloutPoolConfig,
    ValKwargsConfig,
)

TINY_MODEL = "builtin://tiny-qwen2"
ARITH_TRAIN = "builtin://arithmetic/train"
ARITH_TEST = "builtin://arithmetic/test"

__all__ = [
    "TINY_MODEL",
    "ARITH_TRAIN",
    "ARITH_TEST",
    "DataConfig",
    "TiledMLPConfig",
    "FusedKernelOptions",
    "ModelConfig",
    "FSDPConfig",
    "OptimConfig",
    "ActorConfig",
    "RefConfig",
    "ValKwargsConfig",
    "MultiTurnConfig",
    "RolloutConfig",
    "ActorRolloutRefConfig",
    "CriticConfig",
    "KLControlConfig",
    "RolloutCorrectionConfig",
    "AlgorithmConfig",
    "FilterGroupsConfig",
    "AsyncTrainingConfig",
    "RolloutPoolConfig",
    "RewardConfig",
    "CustomRewardFunctionConfig",
    "RewardModelModelConfig",
    "RewardModelRolloutConfig",
    "RewardModelConfig",
    "TrainerConfig",
    "RLSPConfig",
]


@dataclass
class DataConfig(verl_keys.DataVerlKeys):
    train_files: Any = ARITH_TRAIN  # str or list[str] of parquet files
    val_files: Any = ARITH_TEST
    prompt_key: str = "prompt"
    train_batch_size: int = 16  # prompts per step
    gen_batch_size: int | None = None  # dynamic sampling's generation batch (prompts per round; verl's DAPO key); null: train_batch_size
    max_prompt_length: int = 32
    max_response_length: int = 8
    filter_overlong_prompts: bool = True
    apply_chat_template: bool = True  # False: a plain-string prompt is tokenized as written (completion style)
    truncation: str = "error"  # a prompt longer than max_prompt_length that is not filtered: error | left | right | middle (keep its end / start / both ends; verl's)
    shuffle: bool = True  # training prompts in a new order every epoch (seeded by data.seed); false: file order
    return_raw_chat: bool = True  # verl's flag for its async rollout and reward-model template; rlsp keeps each prompt's messages either way (true and false train alike)
    seed: int = 1


@dataclass
class ModelOverrideConfig:
    output_router_logits: bool | None = None  # None: config.json's; true with router_aux_loss_coef > 0: the actor's loss adds the MoE router auxiliary loss (rlsp.engine.router_aux; qwen2_moe, qwen3_moe, mixtral, olmoe, gpt_oss, qwen3_next, qwen3_5_moe)
    router_aux_loss_coef: float | None = None  # None: config.json's; the auxiliary loss's weight (transformers' router_aux_loss_coef)


@dataclass
class ModelConfig:
    path: str = TINY_MODEL
    dtype: str = "float32"  # parameter/compute dtype of the trainer: float32 | bfloat16
    enable_gradient_checkpointing: Any = "auto"  # true | false | auto: on when a micro-batch's activations do not fit beside the training state (rlsp.config.auto)
    use_remove_padding: bool = True  # verl's padded (false) or unpadded forward; rlsp always packs without padding, same logprobs either way: false has no effect (refused with Ulysses sp > 1, as in verl)
    use_shm: bool = False  # copy the model into /dev/shm once and load it from there (one node)
    use_fused_kernels: bool = False  # verl's fused logprob/entropy head; rlsp always computes them vocab-chunked (never the full logits), true or false
    fused_kernel_options: FusedKernelOptions = field(default_factory=FusedKernelOptions)
    enable_activation_offload: bool = False  # saved activations (checkpointed layer inputs) wait in pinned host memory for backward; needs enable_gradient_checkpointing; no effect on cpu
    tiled_mlp: TiledMLPConfig = field(default_factory=TiledMLPConfig)
    lean_rmsnorm: bool = False  # true or false: RMSNorms keep only their input and a per-token fp32 inverse RMS for backward (same outputs; gradients to rounding)
    # LoRA on the actor (peft): the base stays frozen, the reference is the base itself (adapters off).
    lora_rank: int = 0  # > 0: train rank-r LoRA adapters only (peft); 0 = full fine-tuning
    lora_alpha: float = 16  # adapter scale = lora_alpha / lora_rank
    target_modules: Any = "all-linear"  # "all-linear" or a list of linear-layer names (e.g. [q_proj, v_proj]); on fused-expert MoE families gate_proj/up_proj/down_proj (mixtral w1/w3/w2) also adapt the fused experts, never the routers; on a vision-language model the language model only
    exclude_modules: Any = None  # None, or layer names (a list) / a regex (a string) to leave unadapted
    lora_adapter_path: str | None = None  # start from a saved PEFT adapter (its config sets rank and targets)
    # verl's config.json overrides, of the entries rlsp reads at run time (other entries are refused by name).
    override_config: ModelOverrideConfig = field(default_factory=ModelOverrideConfig)


@dataclass
class RouterReplayConfig:
    mode: str = "disabled"  # MoE routing replay (verl's): disabled | R2: the update routes each token to the experts the old-logprob pass chose, weights recomputed from the current router (rlsp.engine.router_replay; qwen2_moe, qwen3_moe, olmoe, mixtral, glm4_moe, deepseek_v3, gpt_oss) | R3: the old-logprob pass and the update route by the rollout engine's routes (rollout.name=hf records them; single-turn, no partial rollouts; verl's rollout.enable_rollout_routing_replay=true says the same)


@dataclass
class ActorConfig(verl_keys.ActorVerlKeys):
    strategy: str = "fsdp2"
    ppo_mini_batch_size: int = 16  # prompts per optimizer step (x rollout.n samples), verl semantics
    ppo_micro_batch_size_per_gpu: int = 32  # samples per forward/backward on one worker
    use_dynamic_bsz: Any = "auto"  # micro-batches filled to a token budget instead of a fixed row count; auto: true unless ppo_micro_batch_size_per_gpu is set (rlsp.config.auto)
    ppo_max_token_len_per_gpu: int = 16384  # that budget, tokens per rank (a packed stream holds budget x sp)
    ppo_epochs: int = 1
    shuffle: bool = True  # reshuffle rows into mini-batches every epoch (when there is more than one)
    # On-policy updates (1 epoch, 1 mini-batch, no KL in the reward): the old logprobs are the update's
    # own forward, detached, instead of a separate pass over the batch. False always recomputes them.
    reuse_update_logprobs: bool = True
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # None = clip_ratio
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)  # loss_mode + per-loss keys (verl's)
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (verl's; policy, KL and entropy terms alike), over the whole mini-batch whatever its micro-batch/dp/sp split
    loss_scale_factor: int | None = None  # seq-mean-token-sum-norm's constant divisor; None = data.max_response_length
    entropy_coeff: float = 0.0
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ulysses_sequence_parallel_size: int = 1  # Ulysses degree: heads exchanged within a node
    ring_sequence_parallel_size: int = 1  # ring degree: K/V blocks passed around (may span nodes)
    tensor_model_parallel_size: int = 1  # Megatron-style TP: each layer's weights split over this many ranks
    sequence_parallel: bool = True  # with TP > 1: norms/residuals sharded along the sequence (Megatron SP)
    # Ulysses degree per micro-batch: the smallest divisor of ulysses_sequence_parallel_size whose token
    # budget (use_dynamic_bsz) holds the micro-batch; the group's other ranks take other micro-batches
    sequence_parallel_adaptive: bool = False
    logprob_chunk_size: int = 1024
    use_torch_compile: Any = "auto"  # true | false | auto: the entropy head's per-block reduction through torch.compile (what verl compiles); auto: on cuda only (inductor's compile costs ~30 s at start-up on cpu)
    calculate_sum_pi_squared: bool = False  # the old-logprob pass also returns sum_v p_v^2 per token (optimal token baselines)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)  # MoE routing replay (R2)
    freeze_vision_tower: bool = False  # vision-language models (qwen2_5_vl, qwen3_vl, qwen3_vl_moe): the vision tower gets no gradient and no optimizer state (verl's key); under LoRA the tower is frozen whatever it says
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RefConfig(verl_keys.RefVerlKeys):
    # Parallel degrees of the frozen reference; None = the actor's value.
    ulysses_sequence_parallel_size: int | None = None
    ring_sequence_parallel_size: int | None = None
    tensor_model_parallel_size: int | None = None
    sequence_parallel: bool | None = None
    sequence_parallel_adaptive: bool | None = None
    log_prob_micro_batch_size_per_gpu: int = 64
    use_torch_compile: Any = None  # None = the actor's value; the reference computes no entropy, so nothing is compiled there
    # As in verl, the token budget follows the actor's unless set.
    log_prob_use_dynamic_bsz: Any = II("actor_rollout_ref.actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int = II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    strategy: str = "fsdp2"  # fsdp | fsdp2: both run rlsp's FSDP2 engine
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class ActorRolloutRefConfig(verl_keys.ActorRolloutRefVerlKeys):
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # (initial) coefficient of the KL penalty in the reward
    target_kl: float = 0.1  # adaptive: the KL the coefficient steers towards
    horizon: int = 10000  # adaptive: samples over which a proportional error is corrected


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 1.0  # GAE lambda
    gdpo_reward_keys: list[str] = field(default_factory=list)  # gdpo: reward-function dict entries normalised separately
    gdpo_reward_weights: list[float] | None = None  # gdpo: one weight per key (None: all 1)
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(actor || ref) from the token rewards
    kl_penalty: str = "kl"  # estimator of that KL: kl | abs | mse | low_var_kl
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO's dynamic sampling


@dataclass
class TrainerConfig(verl_keys.TrainerVerlKeys):
    project_name: str = "rlsp"
    experiment_name: str = "grpo_tiny"
    device: str = "auto"  # auto | cpu | cuda
    nnodes: int = 1
    n_gpus_per_node: int = 2  # worker processes per node (CPU workers when device=cpu)
    total_epochs: int = 30  # passes over the training prompts (verl's default)
    total_training_steps: int | None = None  # None: total_epochs x batches per epoch (verl's rule); set: exactly this many steps
    balance_batch: bool = True  # reorder rows so every dp rank gets a similar number of tokens
    critic_warmup: int = 0  # the first N steps update only the critic (the actor and rollout stay put)
    test_freq: int = 10  # validate every N steps (and at the start and end); <=0 disables
    val_before_train: bool = True
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    logger: Any = field(default_factory=lambda: ["console", "jsonl"])  # a name or a list of: console | jsonl | tensorboard | wandb | mlflow
    seed: int = 0
    cache_dir: str = "~/.cache/rlsp"
    ray_address: str | None = None  # unset: a private local Ray on 127.0.0.1; auto: join the running cluster; host:port: join that one
    sp_self_check: bool = True
    sp_self_check_tol: float = 1e-4
    plot: bool = True
    save_final_model: bool = True  # write the trained actor to <default_local_dir>/actor_hf
    save_freq: int = -1  # checkpoint every N steps; the last step is always saved; <= 0: the last only
    resume_mode: str = "auto"  # auto: continue from the run dir's latest checkpoint | disable | resume_path
    resume_from_path: str | None = None  # resume_mode=resume_path: a global_step_<N> directory
    max_actor_ckpt_to_keep: int | None = None  # keep the actor state of the newest N checkpoints (None: all)
    max_critic_ckpt_to_keep: int | None = None
    save_on_preempt: bool = False  # SIGTERM: finish the step in flight and checkpoint it before stopping
    use_legacy_worker_impl: str = "auto"  # auto | enable | disable: verl's choice between its two worker implementations; rlsp has one (any value)


@dataclass
class RLSPConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    ray_kwargs: verl_keys.RayKwargsConfig = field(default_factory=verl_keys.RayKwargsConfig)  # verl's Ray start-up arguments
    distillation: DistillationConfig = field(default_factory=DistillationConfig)  # on-policy distillation (schema_distill)
