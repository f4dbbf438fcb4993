#!/usr/bin/env bash
# PPO (GAE advantages from a learned critic) on the built-in tiny Qwen2 and the synthetic arithmetic task.
# CPU only, 2 Ray workers; each hosts the FSDP2 actor, the reference, the critic (colocated) and an
# in-process vLLM engine. Extra args are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m rlsp.main --config-name ppo \
    algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=0.95 \
    data.train_batch_size=16 data.max_prompt_length=32 data.max_response_length=8 \
    actor_rollout_ref.model.path=builtin://tiny-qwen2 \
    actor_rollout_ref.actor.optim.lr=1e-3 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.01 \
    actor_rollout_ref.actor.entropy_coeff=0.02 \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0 \
    critic.optim.lr=1e-3 critic.cliprange_value=0.5 \
    critic.ppo_mini_batch_size=16 critic.ppo_micro_batch_size_per_gpu=32 \
    trainer.device=cpu trainer.n_gpus_per_node=2 trainer.nnodes=1 \
    trainer.total_training_steps=150 trainer.test_freq=10 \
    trainer.experiment_name=ppo_tiny_cpu "$@"
