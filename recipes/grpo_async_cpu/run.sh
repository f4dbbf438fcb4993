#!/usr/bin/env bash
# One-step off-policy GRPO on CPU: 1 trainer worker (FSDP2 actor + reference) and 1 rollout worker with its
# own vLLM engine, generating batch j+1 while the trainer works on batch j. Generation streams in units of
# ppo_mini_batch_size=8 prompts (require_batches=2 units per step); with partial_rollout=true the rollout
# worker generates in segments of 4 tokens and picks up new weights between them. The loss is decoupled PPO:
# the rollout engine's logprobs are the behaviour policy, the trainer recomputes the proximal policy and
# weighs each token by pi_prox / pi_rollout (truncated at 2); tokens whose ratio leaves [0.5, 2] are
# rejected. staleness_threshold=0 makes the same command synchronous. Extra args are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m rlsp.main \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=16 data.max_prompt_length=32 data.max_response_length=8 \
    actor_rollout_ref.model.path=builtin://tiny-qwen2 \
    actor_rollout_ref.actor.optim.lr=1e-3 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.01 \
    actor_rollout_ref.actor.entropy_coeff=0.02 \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 \
    trainer.device=cpu trainer.nnodes=1 trainer.n_gpus_per_node=1 \
    rollout.nnodes=1 rollout.n_gpus_per_node=1 \
    async_training.staleness_threshold=1.0 \
    async_training.trigger_parameter_sync_step=1 \
    async_training.require_batches=2 \
    async_training.partial_rollout=true \
    async_training.partial_rollout_segment_tokens=4 \
    async_training.use_rollout_log_probs=true \
    async_training.compute_prox_log_prob=true \
    algorithm.rollout_correction.rollout_is=token \
    algorithm.rollout_correction.rollout_is_threshold=2.0 \
    algorithm.rollout_correction.rollout_rs=token_k1 \
    algorithm.rollout_correction.rollout_rs_threshold=2.0 \
    trainer.total_training_steps=150 trainer.test_freq=10 \
    trainer.experiment_name=grpo_async_cpu "$@"
