"""Start-up checks of the LoRA keys (`actor_rollout_ref.model.lora_*`, verl's names) and of how the
rollout engine gets its weights (`rollout.load_format`, `rollout.layered_summon`).

Arithmetic and file-existence checks only (no torch); called by `validate_config`, which collects
every message into one error.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rlsp.config.layout import ParallelLayout
from rlsp.config.lora_keys import LORA_ALL_LINEAR, LORA_REFUSED_TARGETS, lora_enabled

LOAD_FORMATS = ("auto", "safetensors", "dummy")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # what peft's from_pretrained reads


def adapter_dir_problem(path: str) -> str | None:
    """What a PEFT adapter directory lacks (its config or its weights), or None when both are there."""
    if not os.path.isdir(path):
        return f"is not a PEFT adapter directory: no such directory (expected {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS[0]} in it)"
    if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        return f"has no {ADAPTER_CONFIG}; a PEFT adapter directory holds it and {' or '.join(ADAPTER_WEIGHTS)}"
    if not any(os.path.isfile(os.path.join(path, name)) for name in ADAPTER_WEIGHTS):
        return (f"has {ADAPTER_CONFIG} but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}); point it at a "
                "directory written by peft's save_pretrained (or rlsp.export's lora_adapter/)")
    return None


def _names(value: Any) -> list[Any] | None:
    """A list of layer names from a YAML list (or a plain list), else None."""
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else None


def _check_targets(model: Any, errors: list[str]) -> None:
    key = "actor_rollout_ref.model.target_modules"
    targets = model.target_modules
    names = _names(targets)
    if names is None and targets != LORA_ALL_LINEAR:
        errors.append(f"{key}={targets!r} is not supported; legal values: {LORA_ALL_LINEAR!r} or a list of "
                      "linear-layer names such as [q_proj, k_proj, v_proj, o_proj]")
        return
    if names is not None and (not names or not all(isinstance(n, str) and n for n in names)):
        errors.append(f"{key}={names!r} must be a non-empty list of layer names (or {LORA_ALL_LINEAR!r})")
    refused = sorted(set(names or []) & set(LORA_REFUSED_TARGETS))
    if refused:
        errors.append(f"{key} names {refused}: LoRA adapts the decoder's linear layers only (the logprob head reads "
                      f"lm_head.weight directly; embeddings are not linear); legal targets exclude {list(LORA_REFUSED_TARGETS)}")
    excl = model.exclude_modules
    if excl is not None and not isinstance(excl, str) and not all(isinstance(n, str) for n in _names(excl) or [0]):
        errors.append(f"actor_rollout_ref.model.exclude_modules={excl!r} must be null, a regex string or a list of "
                      "layer names")


def check_lora(cfg: Any, layout: ParallelLayout | None, errors: list[str]) -> None:
    """LoRA keys: legal values, and the layouts LoRA works with."""
    model = cfg.actor_rollout_ref.model
    rank, alpha, path = model.lora_rank, model.lora_alpha, model.lora_adapter_path
    if not isinstance(rank, int) or rank < 0:
        errors.append(f"actor_rollout_ref.model.lora_rank={rank!r} must be an integer >= 0 (0 = full fine-tuning)")
        return
    if not lora_enabled(model):
        return
    if not isinstance(alpha, int | float) or alpha <= 0:
        errors.append(f"actor_rollout_ref.model.lora_alpha={alpha!r} must be a number > 0 (scale = alpha / rank)")
    _check_targets(model, errors)
    if path and (problem := adapter_dir_problem(str(path))):
        errors.append(f"actor_rollout_ref.model.lora_adapter_path={path!r} {problem}")
    if layout is None:
        return
    if layout.actor.tp > 1:
        errors.append(f"actor_rollout_ref.model.lora_rank={rank} with actor_rollout_ref.actor.tensor_model_parallel_size="
                      f"{layout.actor.tp}: LoRA is not supported with tensor parallelism (the adapters would need their "
                      "own column/row split of the layers TP shards); legal: tensor_model_parallel_size=1, or lora_rank=0")
    if layout.has_reference and layout.ref != layout.actor:
        errors.append(f"with LoRA the reference is the actor's own model with the adapters switched off, so it runs on "
                      f"the actor's layout ({layout.actor.describe()}), not {layout.ref.describe()}: leave the "
                      "actor_rollout_ref.ref parallel keys and ref.fsdp_config.fsdp_size at their defaults")


def check_rollout_loading(cfg: Any, errors: list[str]) -> None:
    """verl's rollout.load_format and rollout.layered_summon, in the meaning rlsp can give them."""
    r = cfg.actor_rollout_ref.rollout
    if r.load_format not in LOAD_FORMATS:
        errors.append(f"actor_rollout_ref.rollout.load_format={r.load_format!r} is not supported; legal values: "
                      f"{list(LOAD_FORMATS)}")
    elif r.load_format != "auto" and r.name != "vllm":
        errors.append(f"actor_rollout_ref.rollout.load_format={r.load_format!r} needs rollout.name=vllm (the "
                      f"{r.name!r} engine loads model.path with from_pretrained); legal values here: ['auto']")
    if not r.layered_summon:
        errors.append("actor_rollout_ref.rollout.layered_summon=false is not supported: rlsp's weight sync gathers one "
                      "parameter at a time (finer than verl's per-layer summon) and has no whole-model gather; "
                      "legal values: [true]")
