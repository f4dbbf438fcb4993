#!/usr/bin/env bash
# GRPO with LoRA adapters on Qwen2.5-0.5B-Instruct, one node with 8 GPUs, in the shape of verl's LoRA
# example (examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh): rank-64 adapters on every linear
# layer, alpha 32, a ~10x larger learning rate than full fine-tuning, the frozen base in bf16 (no
# second reference copy: the reference is the actor with its adapters off), vLLM rollouts from merged
# weights. MODEL: a local Hugging Face checkout; DATA: parquet files with verl's columns. Set up with
# `RLSP_DEVICE=cuda make setup`. Not measured on a GPU yet (docs/recipes.md has the CPU LoRA curve).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-$HOME/models/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
exec .venv/bin/python -m rlsp.main --config-name grpo \
    algorithm.adv_estimator=grpo \
    data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet \
    data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=1024 \
    actor_rollout_ref.model.path=$MODEL actor_rollout_ref.model.dtype=bfloat16 \
    actor_rollout_ref.model.lora_rank=64 actor_rollout_ref.model.lora_alpha=32 \
    actor_rollout_ref.model.target_modules=all-linear \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.dtype=bfloat16 \
    actor_rollout_ref.rollout.load_format=safetensors actor_rollout_ref.rollout.layered_summon=true \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    trainer.device=cuda trainer.n_gpus_per_node=8 trainer.nnodes=1 \
    trainer.total_training_steps=300 trainer.test_freq=20 \
    trainer.experiment_name=grpo_qwen2_5_0_5b_lora "$@"
