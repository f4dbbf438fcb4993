#!/usr/bin/env bash
# GRPO with LoRA adapters on SmolLM2-135M-Instruct, 2 CPU cores: the recipe of
# recipes/grpo_smollm2_cpu/run.sh (same task, sizes, sampling and validation) training rank-32 LoRA
# adapters on every linear layer of the decoder (peft) instead of all weights. The base stays frozen
# (in the compute dtype, no optimizer state); AdamW holds state for the 9.8 M adapter weights only (7 % of 135 M);
# vLLM samples from base + scale * B @ A, synced after every update under the base weight names.
# Learning rate 1e-4: LoRA wants about 10x the full fine-tuning rate (1e-5 there).
# Outputs: outputs/rlsp/grpo_smollm2_lora_cpu/, with actor_hf/ the merged model and
# actor_hf/lora_adapter/ the PEFT adapter. See README.md for the measured curve.
# `actor_rollout_ref.actor.use_kl_loss=true` adds the KL loss at the cost of one more forward per step
# (the reference is the base itself: adapters off, no second copy of the model).
# Extra args are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m rlsp.main --config-name grpo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://smollm2-135m-instruct \
    actor_rollout_ref.model.lora_rank=32 actor_rollout_ref.model.lora_alpha=32 \
    actor_rollout_ref.model.target_modules=all-linear \
    data.train_files=builtin://word_problems/train data.val_files=builtin://word_problems/test \
    data.train_batch_size=4 data.max_prompt_length=80 data.max_response_length=48 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=0.5 \
    trainer.device=cpu trainer.n_gpus_per_node=2 trainer.nnodes=1 \
    trainer.total_training_steps=20 trainer.test_freq=5 trainer.val_before_train=true \
    trainer.project_name=rlsp trainer.experiment_name=grpo_smollm2_lora_cpu "$@"
