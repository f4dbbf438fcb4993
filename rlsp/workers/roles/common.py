"""Helpers the roles share: optimizer settings from the config, metric names, the sampling temperature of a
batch, whether an engine offloads its parameters, and the start-up notes on verl keys that have no effect
in rlsp (logged once per process, like the offload notes; `python -m rlsp.check` prints the same)."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlsp.config.run_length import schedule_optimizer_steps, schedule_type, warmup_optimizer_steps
from rlsp.data.batch import Batch
from rlsp.engine.fsdp_offload import log_offload
from rlsp.engine.lr_schedule import Schedule
from rlsp.engine.optim import OptimSettings
from rlsp.utils.logging import get_logger, log_once

log = get_logger("rlsp.workers")


def optim_settings(cfg: DictConfig, role: str) -> OptimSettings:
    """The optimizer of trainable `role` ("actor" or "critic"); the warm-up (verl's keys, in training steps)
    becomes the optimizer steps the engine's scheduler counts."""
    optim = cfg.actor_rollout_ref.actor.optim if role == "actor" else cfg.critic.optim
    overrides = OmegaConf.to_container(optim.override_optimizer_config) if optim.override_optimizer_config else {}
    schedule = Schedule(kind=schedule_type(optim), warmup=warmup_optimizer_steps(cfg, role),
                        total=schedule_optimizer_steps(cfg, role), min_lr_ratio=float(optim.min_lr_ratio),
                        num_cycles=float(optim.num_cycles), zero_indexed_step=bool(optim.zero_indexed_step))
    return OptimSettings(lr=float(optim.lr), betas=tuple(optim.betas), weight_decay=float(optim.weight_decay),
                         schedule=schedule, grad_clip=float(optim.grad_clip), name=str(optim.optimizer),
                         impl=str(optim.optimizer_impl), overrides=dict(overrides))


def torch_compile_enabled(setting: Any, device: torch.device, role: str) -> bool:
    """use_torch_compile of `role` (true | false | auto: on cuda only) resolved, with one logged line saying what
    is compiled; on, the compiled entropy head is built and probed here, so a platform where torch.compile
    fails stops the run at start-up (rlsp.models.logprobs.compiled_block_entropy)."""
    if setting not in (True, False, "auto"):
        raise ValueError(f"use_torch_compile={setting!r} of the {role}; legal values: [true, false, auto]")
    enabled = device.type == "cuda" if setting == "auto" else bool(setting)
    if not enabled:
        log_once(log, f"compile:{role}", "%s: use_torch_compile=%s on %s: nothing compiled", role, setting, device.type)
        return False
    if role == "ref":
        log_once(log, "compile:ref", "ref: use_torch_compile on, but the reference computes no entropy: nothing to compile")
        return False
    from rlsp.models.logprobs import compiled_block_entropy  # noqa: PLC0415

    compiled_block_entropy()
    log_once(log, f"compile:{role}", "%s: use_torch_compile=%s: the entropy head's per-block reduction runs through "
             "torch.compile (the logprobs, the decoder and the backward stay eager)", role, setting)
    return True


def token_budget(enabled: bool, max_tokens: int) -> int | None:
    """Tokens per rank per micro-batch when token-budget micro-batching is on, else None (fixed rows)."""
    return int(max_tokens) if enabled else None


def role_metrics(role: str, metrics: dict[str, float], drop_prefixes: tuple[str, ...] = ()) -> dict[str, float]:
    """Name an engine's update metrics for the driver: `time_<phase>_s_max` (slowest rank) becomes
    `timing/<role>_<phase>_s`, other bare names `<role>/<name>`; namespaced keys stay."""
    out: dict[str, float] = {}
    for key, val in metrics.items():
        if key.startswith(drop_prefixes):
            continue
        if key.startswith("time_") and key.endswith("_max"):
            out[f"timing/{role}_{key[len('time_'):-len('_max')]}"] = val
        else:
            out[key if "/" in key else f"{role}/{key}"] = val
    return out


def batch_temperature(batch: Batch, cfg: DictConfig) -> float:
    """Logprobs are computed at the temperature the rows were sampled with."""
    return float(batch.info.get("temperature", cfg.actor_rollout_ref.rollout.temperature))


def fsdp_offload(fsdp_config: Any, role: str, device: torch.device) -> bool:
    """Whether `role`'s engine offloads its parameters (param_offload or offload_policy: one FSDP2 policy,
    see rlsp.engine.fsdp_offload; the key combinations are checked in rlsp.config.validate_offload)."""
    enabled = bool(fsdp_config.param_offload or fsdp_config.offload_policy)
    log_offload(role, enabled, device)
    return enabled


def note_padding(prefix: str, use_remove_padding: bool, what: str) -> None:
    """verl's use_remove_padding=false only chooses a padded forward of the same model; rlsp packs anyway."""
    if not use_remove_padding:
        log_once(log, f"padding:{prefix}", "%s.use_remove_padding=false has no effect: rlsp always runs packed sequences "
                 "without padding, which computes the same %s as verl's padded forward", prefix, what)


def note_shared_reference_offload(ref_fsdp_config: Any) -> None:
    """With LoRA the reference is the actor's engine with the adapters off: its own offload keys do nothing."""
    if ref_fsdp_config.param_offload or ref_fsdp_config.offload_policy:
        log_once(log, "offload:ref-lora", "actor_rollout_ref.ref.fsdp_config.param_offload / offload_policy=true has "
                 "no effect with LoRA: the reference is the actor's engine with the adapters off and shares its base "
                 "weights, which actor_rollout_ref.actor.fsdp_config.* offloads (or not)")
