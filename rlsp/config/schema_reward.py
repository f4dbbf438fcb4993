"""Reward sections of the schema: rule rewards and a custom reward function, and the reward model (verl's legacy RM
worker or its reward loop on a vLLM pooling engine). Re-exported by rlsp/config/schema.py. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlsp.config.schema_engine import FSDPConfig


@dataclass
class RewardConfig:
    """Rule rewards are looked up by each row's data_source; a custom function overrides them."""

    custom_function_path: str | None = None  # a Python file with the reward function
    custom_function_name: str = "compute_score"
    on_error: str = "raise"  # a reward fn that raises or returns a non-finite/non-number: raise | zero (counted)


@dataclass
class CustomRewardFunctionConfig:
    """verl's spelling of reward.custom_function_path / _name: mapped onto them when the config is composed."""

    path: str | None = None
    name: str | None = None


@dataclass
class RewardModelModelConfig:
    path: str | None = None  # a local HF *ForSequenceClassification checkpoint with one label (required with enable)
    input_tokenizer: str | None = "${actor_rollout_ref.model.path}"  # the rows' tokenizer: if the RM's tokenizer/template differs, samples are re-rendered in its format; null: rows fed as they are (tokenizers must match)
    use_remove_padding: bool = True  # true only: rlsp always scores packed sequences without padding
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RewardModelRolloutConfig:
    """The reward loop's inference engine (use_reward_loop=true): verl's reward_model.rollout keys."""

    name: str = "vllm"  # vllm only (an in-process pooling engine); sglang and trtllm are not implemented
    dtype: str = "bfloat16"  # the engine's compute dtype
    gpu_memory_utilization: float = 0.5  # GPU memory fraction of the engine (colocated with training)
    enforce_eager: bool = True  # no CUDA graphs
    cudagraph_capture_sizes: Any = None  # null only (eager)
    free_cache_engine: bool = True  # sleep the engine between scoring calls on GPU (no-op on CPU)
    data_parallel_size: int = 1  # 1 only: one engine per tensor-parallel group
    expert_parallel_size: int = 1  # 1 only
    tensor_model_parallel_size: int = 1  # policy workers per engine (verl's default: 2); 1 beside a vLLM rollout of another tp: own processes
    max_num_batched_tokens: int = 8192  # tokens per engine step (raised to max_model_len: a sequence is scored whole)
    max_model_len: int | None = None  # longest input scored; null: the reward model's max_position_embeddings
    max_num_seqs: int = 1024  # sequences per engine step
    load_format: str = "auto"  # vLLM's weight loader (auto | safetensors | pt | dummy ...)
    engine_kwargs: Any = field(default_factory=dict)  # empty only
    limit_images: Any = None  # null only (text reward models)
    enable_chunked_prefill: bool = True  # accepted; rlsp scores each sequence in one step (no chunking)
    enable_prefix_caching: bool = True  # accepted; the engine's own cache policy
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = False  # false only (verl asserts it)
    prompt_length: int = 2048  # verl's key; the bound on an input is max_model_len
    response_length: int = 2048  # verl's key; the bound on an input is max_model_len
    cpu_kvcache_space_gib: int = 1  # CPU only: the engine's KV cache (VLLM_CPU_KVCACHE_SPACE)


@dataclass
class RewardModelConfig:
    """A frozen sequence-classification reward model on the policy workers: verl's legacy RM worker (FSDP) or, with
    use_reward_loop, verl's reward loop (a vLLM pooling engine). Its score at the last response token is the
    token-level score; rule rewards then score validation only (verl's rule)."""

    enable: bool = False  # false: this section is not read (verl's rule)
    strategy: str = "fsdp2"  # fsdp or fsdp2: both run rlsp's FSDP2 engine
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int = 64  # sequences per forward on one worker
    use_dynamic_bsz: bool = False  # micro-batches filled to a token budget instead of a fixed row count
    forward_max_token_len_per_gpu: int = 32768  # that budget, tokens per rank
    ulysses_sequence_parallel_size: int = 1  # Ulysses degree of the reward model's forward
    reward_manager: str = "naive"  # naive only: per-row rule rewards for validation
    num_workers: int = 1  # reward-loop processes scoring rule rewards concurrently (Ray actors over chunks of the batch)
    use_reward_loop: bool = False  # true: the reward model served by an in-process vLLM engine (reward_model.rollout)
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)
