"""Reward sections of the schema: rule rewards and a custom reward function, the reward manager (verl's naive or
dapo, with DAPO's overlong reward shaping), dynamic sampling on reward metrics (DAPO's group filter), and the reward
model (verl's legacy RM worker or its reward loop on a vLLM pooling engine). Re-exported by rlsp/config/schema.py.
No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlsp.config.schema_engine import FSDPConfig


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (arXiv:2503.14476, eq. 13), verl's `overlong_buffer_cfg`: a response longer than
    max_resp_len - len tokens gets a penalty growing linearly to -penalty_factor at max_resp_len tokens."""

    enable: bool = False  # needs reward.reward_manager.name=dapo
    len: int = 0  # the buffer: the last `len` tokens before max_resp_len (>= 1 and <= max_resp_len with enable)
    penalty_factor: float = 0.0  # the penalty at max_resp_len tokens (>= 0)
    log: bool = False  # log reward/overlong_reward/mean and reward/overlong/ratio every step


@dataclass
class OverlongBufferAliasConfig:
    """verl's older spelling `reward_model.overlong_buffer.*`: mapped onto reward.reward_kwargs.overlong_buffer_cfg."""

    enable: bool | None = None
    len: int | None = None
    penalty_factor: float | None = None
    log: bool | None = None


@dataclass
class RewardKwargsConfig:
    """Keyword arguments of the reward manager (verl's `reward.reward_kwargs`): the dapo manager's shaping."""

    overlong_buffer_cfg: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    max_resp_len: int | None = None  # the shaping's hard limit; null: data.max_response_length (the only legal value)


@dataclass
class RewardManagerConfig:
    """verl's `reward.reward_manager`: how rows are turned into token-level scores."""

    name: str = "naive"  # naive: the reward function once per row | dapo: the same, plus overlong reward shaping | gdpo: naive, with extra_info.experiment_name


@dataclass
class RewardConfig:
    """Rule rewards are looked up by each row's data_source; a custom function overrides them."""

    custom_function_path: str | None = None  # a Python file with the reward function
    custom_function_name: str = "compute_score"
    on_error: str = "raise"  # a reward fn that raises or returns a non-finite/non-number: raise | zero (counted)
    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    reward_kwargs: RewardKwargsConfig = field(default_factory=RewardKwargsConfig)


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's `algorithm.filter_groups`): prompt groups whose `metric` is the same for every
    sample carry no GRPO signal and are dropped; more prompt batches are generated until data.train_batch_size
    prompts with informative groups are collected (rlsp/step/dynamic_sampling.py)."""

    enable: bool = False
    metric: str | None = None  # acc | score (the reward function's value) | seq_reward | seq_final_reward (token sums)
    max_num_gen_batches: int = 0  # generation rounds per step before giving up; <= 0: no limit


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
    reward_manager: str | None = None  # verl's older spelling of reward.reward_manager.name (mapped onto it)
    overlong_buffer: OverlongBufferAliasConfig = field(default_factory=OverlongBufferAliasConfig)  # verl's older spelling of reward.reward_kwargs.overlong_buffer_cfg
    num_workers: Any = "auto"  # rule scoring processes (Ray actors over chunks of the batch); 0: the policy workers score their own rows; auto: 0, or 1 with a rollout pool (rlsp.config.auto)
    use_reward_loop: bool = False  # true: the reward model served by an in-process vLLM engine (reward_model.rollout)
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)
