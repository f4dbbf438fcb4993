"""Rollout sections of the schema: the policy's rollout engine and its sampling, the rollout pool, async training
(generation overlapped with training) and its off-policy correction. Re-exported by rlsp/config/schema.py. No torch
import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import II

from rlsp.config.schema_verl_runtime import RolloutVerlKeys


@dataclass
class ValKwargsConfig:
    """Sampling of validation rollouts (verl's rollout.val_kwargs)."""

    n: int = 1  # samples per validation prompt (val metrics average over all of them)
    do_sample: bool = False  # false: greedy (temperature, top_p and top_k must stay at their defaults)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts through agent loops, with tools (verl's keys; docs/agents.md)."""

    enable: bool = False  # rows run through agent loops (agent.default_agent_loop or the row's agent_name)
    max_assistant_turns: int | None = None  # None: until the model stops calling tools or the budget ends
    max_user_turns: int | None = None  # tool/observation turns; None: no limit
    tool_config_path: str | None = None  # verl's tool YAML (tools: [{class_name, config, tool_schema}])
    function_tool_path: str | None = None  # a Python file: every public typed function in it is a tool
    max_parallel_calls: int = 1  # tool calls executed per assistant turn (more are answered with an error)
    max_tool_response_length: int = 256  # characters of one tool response (verl's unit)
    tool_response_truncate_side: str = "middle"  # left | middle | right: which part of a long response is kept (verl's meaning)
    format: str = "hermes"  # how tool calls are written: hermes (<tool_call>{json}</tool_call>)
    interaction_config_path: str | None = None  # verl's simulated-user interactions: null only (write an agent loop)
    use_inference_chat_template: bool = False  # true or false: rlsp never re-renders a trajectory (the generated ids train)
    tokenization_sanity_check_mode: str = "strict"  # strict | ignore_strippable | disable: nothing to check in rlsp (no re-tokenization)
    num_repeat_rollouts: int | None = None  # verl's interaction repeats: null only
    tool_timeout_s: float = 30.0  # rlsp's: seconds one tool call may take before it is answered with an error
    max_tokens_per_turn: int | None = None  # rlsp's: new tokens per assistant turn; None = what is left of data.max_response_length
    use_step_rewards: bool = False  # rlsp's: tool step rewards join the reward at the end of the turn that earned them


@dataclass
class CustomAsyncServerConfig:
    path: str | None = None  # verl's own server class: null only (rlsp's engine runs in-process)
    name: str | None = None


@dataclass
class AgentLoopConfig:
    """Agent loops (verl's rollout.agent.*; docs/agents.md)."""

    num_workers: int = 8  # verl's agent-loop workers; rlsp runs every trajectory of a worker concurrently on one event loop, so any value >= 1 behaves alike
    default_agent_loop: str = "single_turn_agent"  # the loop of rows without agent_name: single_turn_agent | tool_agent | a registered name
    agent_loop_config_path: str | None = None  # YAML list of {name, _target_} registering user loops
    custom_async_server: CustomAsyncServerConfig = field(default_factory=CustomAsyncServerConfig)


@dataclass
class RolloutConfig(RolloutVerlKeys):
    name: str = "auto"  # vllm | hf | auto: hf on cpu for models of <= 10M parameters, else vllm (rlsp.config.auto)
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    dtype: str = "float32"  # weights dtype of the rollout engine
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.5
    cpu_kvcache_space_gib: int = 1
    log_prob_micro_batch_size_per_gpu: int = 64
    log_prob_use_dynamic_bsz: Any = II("actor_rollout_ref.actor.use_dynamic_bsz")  # old-logprob pass: token-budget micro-batches (the actor's setting unless set)
    log_prob_max_token_len_per_gpu: int = II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    mode: str = "sync"  # sync | async (verl's serving mode); rlsp's engine runs in-process in each worker and generates the same samples in both (multi-turn too)
    free_cache_engine: bool = True  # free the engine's KV cache and weights while training (GPU); rlsp always does: true only
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    ignore_eos: bool = False  # sample max_response_length tokens even past EOS (fixed-length benchmarks; vllm only)
    load_format: str = "auto"  # vLLM's first weights: auto | safetensors (read model.path) | dummy (random; synced from the actor before generating)
    layered_summon: bool = True  # weight sync gathers one parameter at a time (finer than per layer); false (whole-model gather) is refused
    tensor_model_parallel_size: int = 1  # vLLM TP: k consecutive workers (one node) run one engine, each holding 1/k of the weights; vllm only
    enable_rollout_routing_replay: bool = False  # verl's R3 switch: true is actor.router_replay.mode=R3 (the same setting; another mode with it is refused)


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between the rollout engine's logprobs and the trainer's (verl's keys; docs/async.md)."""

    rollout_is: str | None = None  # importance weights pi_old / pi_rollout: null | token | sequence
    rollout_is_threshold: float = 2.0  # truncate the weights above this
    rollout_is_batch_normalize: bool = False  # divide the truncated weights by their batch mean
    rollout_rs: str | None = None  # rejection: null or comma-separated token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2/k3
    rollout_rs_threshold: Any = None  # per option: an upper bound, or "lower_upper" ratio bounds for *_k1
    bypass_mode: bool = False  # true: the rollout logprobs are the old policy and the correction runs in the loss (2 policies)
    loss_type: str = "ppo_clip"  # bypass_mode's policy loss: ppo_clip (PPO clip on pi_theta / pi_rollout) | reinforce (IS-weighted PG)


@dataclass
class AsyncTrainingConfig:
    """Generation on a rollout pool of its own, overlapped with training (verl's keys; docs/async.md)."""

    staleness_threshold: float = 0.0  # 0: synchronous; s > 0: up to floor(s x trigger x require_batches) mini-batches ahead
    trigger_parameter_sync_step: int = 1  # trainer updates between weight syncs to the rollout pool
    require_batches: int = 1  # ppo mini-batches per trainer step (x ppo_mini_batch_size = data.train_batch_size)
    partial_rollout: bool = False  # generate in segments; between them pick up newer weights and continue with them
    partial_rollout_segment_tokens: int = 64  # rlsp's: new tokens per sample between weight pick-ups (partial_rollout)
    use_rollout_log_probs: bool = False  # true: the rollout engine's logprobs are the behaviour policy of the loss
    compute_prox_log_prob: bool = False  # with use_rollout_log_probs: recompute the proximal policy (decoupled PPO)


@dataclass
class RolloutPoolConfig:
    """Workers that only generate, each with its own engine (verl's `rollout.*`); 0 = on the policy workers."""

    nnodes: int = 1
    n_gpus_per_node: int = 0  # > 0: a rollout pool of nnodes x n_gpus_per_node workers (needs async_training)
