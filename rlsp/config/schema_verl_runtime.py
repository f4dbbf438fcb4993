"""verl's engine and runtime keys that rlsp declares with verl's names and defaults: Ray start-up (`ray_kwargs.*`),
the rollout engine's vLLM options, length caps and weight-transfer settings, entropy memory switches, checkpoint
contents, validation-sample logging, the image resize patch (data.image_patch_size). Mixed into the sections of rlsp/config/schema.py (one base class per section), so
each section keeps its own fields there. No torch import here.

What each key does in rlsp (some are verl's results reached another way) is in rlsp.config.verl_compat
(VERL_NOTES) and docs/config.md; legal values are checked by rlsp.config.validate_verl_runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# What a checkpoint holds (verl's names): rlsp always writes the model, optimizer and extra (scheduler,
# RNG, data position) state, what a resume needs. verl's fourth entry, hf_model, in the actor's save_contents
# adds an HF-format copy of the actor to every checkpoint (<global_step_N>/actor_hf).
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")
HF_MODEL = "hf_model"
DEFAULT_CHECKPOINT_CONTENTS = ["model", "optimizer", "extra"]


@dataclass
class CheckpointContentsConfig:
    """verl's `<role>.checkpoint.*`: what a checkpoint of the role saves and loads."""

    save_contents: list[str] = field(default_factory=lambda: list(DEFAULT_CHECKPOINT_CONTENTS))
    load_contents: list[str] | None = None  # None: save_contents (verl's ${.save_contents})
    async_save: bool = False  # false only: rlsp writes a checkpoint before the next step starts


@dataclass
class EntropyMemoryKeys:
    """verl's switches for the memory of the entropy computation (rlsp computes it vocab-chunked either way)."""

    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False


@dataclass
class ActorVerlKeys(EntropyMemoryKeys):
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)


@dataclass
class RefVerlKeys(EntropyMemoryKeys):
    pass


@dataclass
class CriticVerlKeys:
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)


@dataclass
class CheckpointEngineConfig:
    """verl's `rollout.checkpoint_engine.*`: how trained weights reach the rollout engine."""

    backend: str = "naive"  # naive | nccl (verl's); rlsp picks its transfer from the layout (see VERL_NOTES)
    update_weights_bucket_megabytes: int = 2048  # verl's transfer bucket; rlsp sends one tensor at a time
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # empty only


@dataclass
class RolloutEngineKwargs:
    """verl's `rollout.engine_kwargs.<engine>.*`: extra engine arguments. verl's scripts set the SGLang and
    TensorRT-LLM blocks whatever engine runs; rlsp accepts them beside its own engines and says at start-up
    that they are ignored (an engine not in use; rollout.name=sglang/trtllm stays refused)."""

    vllm: dict[str, Any] = field(default_factory=dict)  # passed to vllm.LLM(...) as keyword arguments
    sglang: dict[str, Any] = field(default_factory=dict)  # engine not in use: ignored (noted at start-up)
    trtllm: dict[str, Any] = field(default_factory=dict)  # engine not in use: ignored (noted at start-up)


@dataclass
class RolloutVerlKeys:
    """verl's vLLM engine options of the policy's rollout engine (rlsp/workers/roles/rollout.py passes them on)."""

    calculate_log_probs: bool = False  # true or false: rlsp's engine always returns the sampled tokens' logprobs
    enable_chunked_prefill: bool = True  # vLLM's chunked prefill (GPU; off on CPU, see VERL_NOTES)
    max_num_batched_tokens: int = 8192  # tokens per vLLM scheduler step
    max_num_seqs: int = 256  # sequences per vLLM scheduler step
    max_model_len: int | None = None  # verl's engine context cap: null or >= prompt + response (where it never binds)
    data_parallel_size: int = 1  # 1 only: every engine is one tensor-parallel group of policy workers
    expert_parallel_size: int = 1  # 1, or tensor_model_parallel_size with vllm on GPU: vLLM spreads the experts over the engine's ranks (enable_expert_parallel) instead of splitting each expert (verl's rule: tp x dp, dp = 1 here)
    # GPU vLLM: a weight sync wakes the weights, loads them, then the KV cache (lower peak memory); CPU: no sleep mode
    multi_stage_wake_up: bool = False
    prompt_length: int | None = None  # verl's engine prompt cap (its default: data.max_prompt_length): null or that value
    response_length: int | None = None  # verl's generation limit (its default: data.max_response_length): null or that value
    engine_kwargs: RolloutEngineKwargs = field(default_factory=RolloutEngineKwargs)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)


@dataclass
class ActorRolloutRefVerlKeys:
    nccl_timeout: int = 600  # seconds: the timeout of every worker process group (gloo and nccl; verl's default)


@dataclass
class DataVerlKeys:
    filter_overlong_prompts_workers: int = 1  # verl's filter processes; rlsp counts prompt lengths in the driver
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the policy tokenizer's apply_chat_template wherever a prompt or agent turn is rendered (e.g. enable_thinking: false for Qwen3)
    image_patch_size: int | None = None  # verl's resize patch for images: null or the model processor's patch_size (checked on data with images)


@dataclass
class TrainerVerlKeys:
    log_val_generations: int = 0  # validation samples (prompt, response, score) written per validation


@dataclass
class RuntimeEnvConfig:
    """verl's `ray_kwargs.ray_init.runtime_env`: the Ray runtime environment of the run's job (every Ray process
    rlsp starts: workers, scoring and reward processes), for a private Ray and a joined cluster alike."""

    env_vars: dict[str, str] = field(default_factory=dict)  # set in every worker process (rlsp's own names refused)
    py_executable: str | None = None  # a launcher for the worker processes' Python (e.g. `uv run --frozen`); None: this Python


@dataclass
class RayInitConfig:
    """Arguments of the private local Ray that rlsp starts (num_cpus, object_store_memory: ignored when joining a
    cluster, trainer.ray_address); runtime_env applies to both."""

    num_cpus: int | None = None  # CPUs Ray may schedule; None: this machine's cores (at least one per worker)
    object_store_memory: int | None = None  # bytes of Ray's object store; None: rlsp's 512 MiB
    runtime_env: RuntimeEnvConfig = field(default_factory=RuntimeEnvConfig)


@dataclass
class RayKwargsConfig:
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    timeline_json_file: str | None = None  # null only: Ray timelines are not written (timing/* metrics are)
