#!/usr/bin/env bash
# GRPO on SmolLM2-135M-Instruct learning to call a calculator tool (multi-turn agent rollouts) on
# arithmetic whose operands are too large to do in the head, on 2 CPU cores: 2 workers (FSDP2 over
# gloo, one in-process vLLM engine each). See README.md for the measured curve and why these sizes.
# Extra args are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m rlsp.main --config-name grpo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://smollm2-135m-instruct \
    data.train_files=builtin://calculator_problems/train data.val_files=builtin://calculator_problems/test \
    data.train_batch_size=4 data.max_prompt_length=208 data.max_response_length=128 \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=0.7 \
    actor_rollout_ref.rollout.multi_turn.enable=true \
    actor_rollout_ref.rollout.multi_turn.tool_config_path=recipes/grpo_tool_calculator_cpu/tools.yaml \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3 \
    actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=64 \
    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent \
    trainer.device=cpu trainer.n_gpus_per_node=2 trainer.nnodes=1 \
    trainer.total_training_steps=12 trainer.test_freq=4 trainer.val_before_train=true \
    trainer.project_name=rlsp trainer.experiment_name=grpo_tool_calculator_cpu "$@"
