"""Start-up checks of verl's engine and runtime keys (rlsp.config.schema_verl_runtime).

Values only (no torch, no files): `check_verl_runtime_keys` appends one message per refused value, naming the
key, the value and what is legal. data.image_patch_size is checked here as a value only; against the model's
processor by the preflight stage (rlsp.data.vision_processor.image_patch_size_errors), which reads the model files.
The vLLM options built from these keys live with the rollout (rlsp.rollout.engine_options).
"""

from __future__ import annotations

import shlex
from typing import Any

from omegaconf import OmegaConf

from rlsp.config.schema_verl_runtime import CHECKPOINT_CONTENTS, HF_MODEL

ROLLOUT = "actor_rollout_ref.rollout"
# Environment variables rlsp sets in every worker process (ray_kwargs.ray_init.runtime_env.env_vars may not), and why.
WORKER_ENV_NAMES = {
    **dict.fromkeys(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RLSP_WORKER_GROUP"),
                    "the worker's place in its process group"),
    "CUDA_VISIBLE_DEVICES": "Ray gives each worker its GPU",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "vLLM runs in the worker's own process",
}
CPU_WORKER_ENV_NAMES = dict.fromkeys(("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"),
                                     "on CPU each worker binds its own share of the cores")
# Weight-transfer back-ends of verl's checkpoint engine that rlsp accepts (see VERL_NOTES).
CHECKPOINT_ENGINE_BACKENDS = ("naive", "nccl")
# vllm.LLM arguments rlsp sets from its own keys: engine_kwargs.vllm may not set them a second time.
OWN_VLLM_OPTIONS = {
    "model": "actor_rollout_ref.model.path", "dtype": f"{ROLLOUT}.dtype", "seed": "trainer.seed",
    "max_model_len": "data.max_prompt_length + data.max_response_length", "enforce_eager": f"{ROLLOUT}.enforce_eager",
    "gpu_memory_utilization": f"{ROLLOUT}.gpu_memory_utilization", "load_format": f"{ROLLOUT}.load_format",
    "tensor_parallel_size": f"{ROLLOUT}.tensor_model_parallel_size", "enable_prefix_caching": "(always on)",
    "distributed_executor_backend": "(rlsp's external_launcher)", "logprobs_mode": "(processed_logprobs)",
    "enable_chunked_prefill": f"{ROLLOUT}.enable_chunked_prefill",
    "enable_expert_parallel": f"{ROLLOUT}.expert_parallel_size",
    "max_num_batched_tokens": f"{ROLLOUT}.max_num_batched_tokens", "max_num_seqs": f"{ROLLOUT}.max_num_seqs",
    "enable_sleep_mode": "(on for GPU)", "multi_stage_wake_up": f"{ROLLOUT}.multi_stage_wake_up",
}


def _positive_int(key: str, value: Any, errors: list[str]) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        errors.append(f"{key}={value!r} must be an integer >= 1")


def _check_rollout(cfg: Any, errors: list[str]) -> None:
    r = cfg.actor_rollout_ref.rollout
    for key in ("max_num_batched_tokens", "max_num_seqs"):
        _positive_int(f"{ROLLOUT}.{key}", r[key], errors)
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if not r.enable_chunked_prefill and isinstance(r.max_num_batched_tokens, int) and r.max_num_batched_tokens < longest:
        errors.append(f"{ROLLOUT}.max_num_batched_tokens={r.max_num_batched_tokens} is smaller than a whole sequence "
                      f"(data.max_prompt_length + data.max_response_length = {longest}) with {ROLLOUT}."
                      "enable_chunked_prefill=false: vLLM could not schedule a long prompt; raise it or enable "
                      "chunked prefill")
    cap = r.max_model_len
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < longest):
        errors.append(f"{ROLLOUT}.max_model_len={cap!r} is smaller than a whole sequence (data.max_prompt_length + "
                      f"data.max_response_length = {longest}): verl's engine would cut prompts or responses at it, "
                      f"rlsp's engine holds every whole sequence; legal values: null or an integer >= {longest}")
    _check_engine_lengths(cfg, errors)
    if r.data_parallel_size != 1:
        errors.append(f"{ROLLOUT}.data_parallel_size={r.data_parallel_size} is not supported: every rlsp rollout engine "
                      f"is one tensor-parallel group of policy workers ({ROLLOUT}.tensor_model_parallel_size); legal "
                      "values: [1]")
    for key in sorted(set(r.engine_kwargs.vllm) & set(OWN_VLLM_OPTIONS)):
        errors.append(f"{ROLLOUT}.engine_kwargs.vllm.{key} is set by rlsp from {OWN_VLLM_OPTIONS[key]}; set that "
                      "instead")
    if r.engine_kwargs.vllm and r.name != "vllm":
        errors.append(f"{ROLLOUT}.engine_kwargs.vllm is only read by the vllm engine ({ROLLOUT}.name={r.name!r})")
    ce, key = r.checkpoint_engine, f"{ROLLOUT}.checkpoint_engine"
    if ce.backend not in CHECKPOINT_ENGINE_BACKENDS:
        errors.append(f"{key}.backend={ce.backend!r} is not supported: rlsp moves weights in process (colocated "
                      f"engines) or through its weight board (a rollout pool); legal values: {list(CHECKPOINT_ENGINE_BACKENDS)}")
    _positive_int(f"{key}.update_weights_bucket_megabytes", ce.update_weights_bucket_megabytes, errors)
    if ce.engine_kwargs:
        errors.append(f"{key}.engine_kwargs={OmegaConf.to_container(ce.engine_kwargs)} is not supported: rlsp's weight "
                      "transfer has no engine options; legal: {}")


def _check_engine_lengths(cfg: Any, errors: list[str]) -> None:
    """verl's rollout.prompt_length / response_length: null or the data lengths they default to in verl (rlsp's engine
    takes prompts of data.max_prompt_length and generates data.max_response_length tokens, with no separate caps)."""
    r = cfg.actor_rollout_ref.rollout
    for key, data_key, what in (("prompt_length", "max_prompt_length", "takes prompts of up to"),
                                ("response_length", "max_response_length", "generates up to")):
        value, length = r[key], cfg.data[data_key]
        if value is not None and (isinstance(value, bool) or value != length):
            errors.append(f"{ROLLOUT}.{key}={value!r} differs from data.{data_key}={length}: rlsp's rollout engine "
                          f"{what} data.{data_key} tokens (verl's default for {ROLLOUT}.{key}) and has no separate "
                          f"cap; legal values: null or {length} (data.{data_key} sets the limit)")


def _check_checkpoint(prefix: str, ckpt: Any, errors: list[str]) -> None:
    for name in ("save_contents", "load_contents"):
        contents = ckpt[name]
        if contents is None and name == "load_contents":
            continue
        if name == "save_contents" and prefix == "actor_rollout_ref.actor" and HF_MODEL in contents:
            rest = sorted(set(contents) - {HF_MODEL})  # the resumable parts are written either way
            if rest and rest != sorted(CHECKPOINT_CONTENTS):
                errors.append(f"{prefix}.checkpoint.{name}={list(contents)} is not supported: rlsp checkpoints always "
                              f"hold model, optimizer and extra (what a resume needs), hf_model adds an HF-format copy; "
                              f"legal: {list(CHECKPOINT_CONTENTS)}, ['hf_model'] or {[*CHECKPOINT_CONTENTS, HF_MODEL]}")
        elif HF_MODEL in contents:
            errors.append(f"{prefix}.checkpoint.{name}={list(contents)}: hf_model (an HF-format copy in every checkpoint) "
                          "is supported for the actor's save_contents only (rlsp resumes from its own shards; the "
                          "critic has no HF export); legal: "
                          f"{list(CHECKPOINT_CONTENTS)}")
        elif sorted(contents) != sorted(CHECKPOINT_CONTENTS):
            errors.append(f"{prefix}.checkpoint.{name}={list(contents)} is not supported: rlsp checkpoints always hold "
                          "model, optimizer and extra (scheduler, RNG and data position: what a resume needs); "
                          f"legal: {list(CHECKPOINT_CONTENTS)}")
    if ckpt.async_save:
        errors.append(f"{prefix}.checkpoint.async_save=true is not supported: rlsp writes each checkpoint before the "
                      "next step starts; legal values: [false]")


def _check_runtime(cfg: Any, errors: list[str]) -> None:
    t, ray_init = cfg.trainer, cfg.ray_kwargs.ray_init
    _positive_int("data.filter_overlong_prompts_workers", cfg.data.filter_overlong_prompts_workers, errors)
    if cfg.data.image_patch_size is not None:  # against the model's processor: rlsp.data.vision_processor (preflight)
        _positive_int("data.image_patch_size", cfg.data.image_patch_size, errors)
    if not isinstance(t.log_val_generations, int) or t.log_val_generations < 0:
        errors.append(f"trainer.log_val_generations={t.log_val_generations!r} must be an integer >= 0")
    if ray_init.num_cpus is not None:
        workers = t.nnodes * t.n_gpus_per_node
        if t.device == "cpu":
            errors.append(f"ray_kwargs.ray_init.num_cpus={ray_init.num_cpus} with trainer.device=cpu is not supported: "
                          "CPU workers share this machine's cores equally (Ray needs all of them); leave it null")
        elif not isinstance(ray_init.num_cpus, int) or ray_init.num_cpus < workers:
            errors.append(f"ray_kwargs.ray_init.num_cpus={ray_init.num_cpus} is fewer than the run's {workers} workers "
                          "(each holds one CPU slot); raise it or leave it null")
    if ray_init.object_store_memory is not None:
        _positive_int("ray_kwargs.ray_init.object_store_memory", ray_init.object_store_memory, errors)
    if cfg.ray_kwargs.timeline_json_file is not None:
        errors.append(f"ray_kwargs.timeline_json_file={cfg.ray_kwargs.timeline_json_file!r} is not supported: rlsp "
                      "does not write Ray timelines (every step logs timing/* metrics); legal values: [null]")


def _check_runtime_env(cfg: Any, errors: list[str]) -> None:
    env, key = cfg.ray_kwargs.ray_init.runtime_env, "ray_kwargs.ray_init.runtime_env"
    reserved = dict(WORKER_ENV_NAMES, **(CPU_WORKER_ENV_NAMES if cfg.trainer.device == "cpu" else {}))
    for name, value in env.env_vars.items():
        if name in reserved:
            errors.append(f"{key}.env_vars.{name}={value!r} is not supported: rlsp sets {name} in every worker process "
                          f"({reserved[name]}); leave it out")
        elif value is None:
            errors.append(f"{key}.env_vars.{name}=null: an environment variable's value must be a string")
    launcher = env.py_executable
    if launcher is not None:
        try:
            words = shlex.split(str(launcher))
        except ValueError as exc:
            words, why = [], f"cannot be split into words ({exc})"
        else:
            why = "is empty"
        if not isinstance(launcher, str) or not words:
            errors.append(f"{key}.py_executable={launcher!r} {why}: legal values: null (this Python) or a command "
                          "that runs Python, e.g. 'uv run --frozen' or '/path/to/venv/bin/python'")


def check_verl_runtime_keys(cfg: Any, errors: list[str]) -> None:
    """verl's engine and runtime keys: rollout engine options, checkpoint contents, Ray start-up."""
    _check_rollout(cfg, errors)
    _check_checkpoint("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.checkpoint, errors)
    _check_checkpoint("critic", cfg.critic.checkpoint, errors)
    _check_runtime(cfg, errors)
    _check_runtime_env(cfg, errors)
    _positive_int("actor_rollout_ref.nccl_timeout", cfg.actor_rollout_ref.nccl_timeout, errors)
