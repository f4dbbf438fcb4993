#!/usr/bin/env bash
# GRPO on the built-in tiny vision-language model (a random-init Qwen2.5-VL: char tokenizer + vision tokens + one token
# per colour name, PIL image processor, a 2-block vision tower) and the synthetic visual task: "what colour is the
# shape?" about one shape drawn with PIL (4 answers: red, green, blue, yellow), rlsp's shapes reward, a 2-token
# response budget (the colour, the end of the turn). CPU only: 2 workers forming one Ulysses sp=2 group (FSDP2 over
# gloo), hf rollouts with the images. Greedy validation on the 64 held-out images every 25 steps (0 -> 1.0, README.md).
# Extra args are Hydra overrides, e.g. `trainer.total_training_steps=500`.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-outputs/rlsp/grpo_vlm_cpu/data}
.venv/bin/python -m rlsp.data.tasks.shapes --out "$DATA" --n-train 512 --n-test 64 --kinds colour
exec .venv/bin/python -m rlsp.main \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://tiny-qwen2.5-vl \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
    data.train_batch_size=8 data.max_prompt_length=96 data.max_response_length=2 \
    actor_rollout_ref.actor.optim.lr=3e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.actor.entropy_coeff=0.15 \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 \
    actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.n=16 actor_rollout_ref.rollout.temperature=1.0 \
    trainer.device=cpu trainer.n_gpus_per_node=2 trainer.nnodes=1 \
    trainer.total_training_steps=200 trainer.test_freq=25 trainer.val_before_train=true \
    trainer.experiment_name=grpo_vlm_cpu "$@"
