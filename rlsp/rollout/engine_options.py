"""The vllm.LLM options of verl's rollout keys (scheduler limits, chunked prefill, engine_kwargs.vllm) that
rlsp/workers/roles/rollout.py passes on top of the options it sets itself (the ones
rlsp.config.validate_verl_runtime.OWN_VLLM_OPTIONS keeps out of engine_kwargs.vllm). No vllm import here.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf


def vllm_engine_options(rollout: Any, max_model_len: int, on_gpu: bool) -> dict[str, Any]:
    """The vllm.LLM keyword arguments of verl's rollout keys: scheduler limits, chunked prefill and
    engine_kwargs.vllm. On CPU chunked prefill stays off (vLLM's seeded sampling cannot rewind a CPU generator
    after a split prefill, see rlsp/rollout/vllm_engine.py), so a step must hold a whole prompt: the token
    budget is raised to max_model_len there."""
    tokens = int(rollout.max_num_batched_tokens)
    options = {"max_num_batched_tokens": tokens if on_gpu else max(tokens, max_model_len),
               "max_num_seqs": int(rollout.max_num_seqs), **OmegaConf.to_container(rollout.engine_kwargs.vllm, resolve=True)}
    if on_gpu:
        options["enable_chunked_prefill"] = bool(rollout.enable_chunked_prefill)
    if int(rollout.expert_parallel_size) > 1:  # the experts spread over the engine's tp ranks (rollout_ep_errors)
        options["enable_expert_parallel"] = True
    return options
