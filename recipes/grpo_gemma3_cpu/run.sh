#!/usr/bin/env bash
# GRPO on Gemma 3 270M, the real pretrained base model (gemma3_text: 18 layers, 15 sliding-window + 3 global,
# 4 query / 1 KV heads of dim 256, vocabulary 262,144), on 2 CPU cores: 2 workers forming one Ulysses sp=2 group
# (FSDP2 over gloo), hf rollouts. Task: one-digit additions "a+b=" as plain-text prompts (the base model has no
# chat template) after one worked example ("12+5=17"), rlsp's arithmetic reward (1.0 for exactly the right number);
# a 2-token response budget, so the first number the model writes is its answer. Greedy validation on the 20
# held-out pairs (0.60 -> 0.90 in 12 steps, README.md).
# Extra args are Hydra overrides, e.g. `trainer.total_training_steps=20`.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-outputs/rlsp/grpo_gemma3_cpu/data}
.venv/bin/python recipes/grpo_gemma3_cpu/make_data.py --out "$DATA"
exec .venv/bin/python -m rlsp.main --config-name grpo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://gemma3-270m \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" data.apply_chat_template=false \
    data.train_batch_size=8 data.max_prompt_length=16 data.max_response_length=2 \
    actor_rollout_ref.actor.optim.lr=2e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 \
    actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0 \
    trainer.device=cpu trainer.n_gpus_per_node=2 trainer.nnodes=1 \
    trainer.total_training_steps=12 trainer.test_freq=4 trainer.val_before_train=true \
    trainer.project_name=rlsp trainer.experiment_name=grpo_gemma3_cpu "$@"
