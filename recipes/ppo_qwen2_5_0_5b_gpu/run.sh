#!/usr/bin/env bash
# PPO on Qwen2.5-0.5B-Instruct, one node with 8 GPUs: actor, reference, critic and vLLM colocated on
# every GPU (verl's hybrid layout), Ulysses sp=2 for the actor and the critic (dp=4), bf16 compute
# over fp32 master weights. MODEL: a local Hugging Face checkout (the critic starts from it too);
# DATA: parquet files in verl's layout. Set up with `RLSP_DEVICE=cuda make setup`.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-$HOME/models/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
# --config-name ppo selects the critic; every value tuned for the tiny demo is overridden below.
exec .venv/bin/python -m rlsp.main --config-name ppo \
    algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=1.0 \
    algorithm.use_kl_in_reward=false \
    data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet \
    data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=1024 \
    actor_rollout_ref.model.path=$MODEL actor_rollout_ref.model.dtype=bfloat16 \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.entropy_coeff=0.0 \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=1 actor_rollout_ref.rollout.dtype=bfloat16 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    critic.optim.lr=1e-5 critic.model.enable_gradient_checkpointing=true \
    critic.ppo_mini_batch_size=64 critic.ppo_micro_batch_size_per_gpu=16 \
    critic.ulysses_sequence_parallel_size=2 critic.cliprange_value=0.5 \
    trainer.critic_warmup=0 \
    trainer.device=cuda trainer.n_gpus_per_node=8 trainer.nnodes=1 \
    trainer.total_training_steps=300 trainer.test_freq=20 \
    trainer.experiment_name=ppo_qwen2_5_0_5b "$@"
