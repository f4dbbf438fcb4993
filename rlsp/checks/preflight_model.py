"""Preflight checks of the model against the run: the layout's degrees against the model's heads and experts,
rows with images against the model (a Qwen3.5 wrapper loads its vision tower for them), and the MoE
settings (routing replay, the router auxiliary loss). Plain functions; rlsp.checks.preflight registers them in
run order.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from rlsp.config.checks import CheckContext
from rlsp.config.layout import ParallelLayout
from rlsp.config.lora_keys import lora_enabled
from rlsp.config.run_spec import agent_loops_enabled
from rlsp.data.vision_processor import image_patch_size_errors, image_rows, image_run_errors, vision_data_errors
from rlsp.data.vision_run import data_files, model_type_of, policy_vision_tower
from rlsp.engine.router_aux import router_aux_errors, with_overrides
from rlsp.engine.router_replay import replay_config_errors
from rlsp.models.family_checks import check_ring_support, check_sp_support, check_tp_windowed
from rlsp.models.lora_targets import expert_parallel_lora_problem
from rlsp.models.vision_inputs import VISION_FAMILIES
from rlsp.models.vision_lora import lora_target_errors
from rlsp.parallel.ep_checks import check_ep_support
from rlsp.parallel.tp_checks import check_tp_support
from rlsp.rollout.support import rollout_ep_errors


def degree_errors(config: Any, layout: ParallelLayout, errors: list[str]) -> None:
    """Every training role's Ulysses and tensor-parallel degrees must suit the model's heads, its expert-parallel
    degree the model's experts."""
    prefixes = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "critic": "critic"}
    for role, prefix in prefixes.items():
        if role == "critic" and not layout.has_critic:
            continue
        degrees = layout.role(role)
        for check, key, value in ((check_sp_support, "ulysses_sequence_parallel_size", degrees.ulysses),
                                  (check_ring_support, "ring_sequence_parallel_size", degrees.ring),
                                  (check_tp_windowed, "tensor_model_parallel_size", degrees.tp),
                                  (check_tp_support, "tensor_model_parallel_size", degrees.tp),
                                  (check_ep_support, f"{'model.' if role == 'critic' else ''}fsdp_config."
                                                     "expert_parallel_size", degrees.ep)):
            try:
                check(config, value)
            except ValueError as exc:
                errors.append(f"{prefix}.{key}: {exc}")


def check_wrapper_tower(cfg: DictConfig, layout: ParallelLayout | None, errors: list[str]) -> None:
    """A vision-language model loads with its vision tower: Qwen2.5-VL / Qwen3-VL(-MoE) always, a Qwen3.5 wrapper
    checkpoint (qwen3_5 / qwen3_5_moe) when the run's rows carry images (rlsp.data.vision_run). LoRA then adapts its
    language model only: a target found in the tower only is refused by name (rlsp.models.vision_lora; part of the
    `model` check). Tiled MLP and lean RMSNorm take the language model (their family rules: feature_support).
    Tensor parallelism takes a wrapper's text model (the degree checks read its text config) but not the wrapper
    with its tower: refused here by role, as for the other vision-language families (family_checks)."""
    try:
        tower = policy_vision_tower(cfg)
    except RuntimeError:  # a missing data file: the data_files check names it
        return
    path = cfg.actor_rollout_ref.model.path
    family, model = model_type_of(path), cfg.actor_rollout_ref.model
    if lora_enabled(model) and (tower or family in VISION_FAMILIES):
        errors.extend(lora_target_errors(path, model))
    for role in ("actor", "ref"):
        if tower and layout is not None and (tp := layout.role(role).tp) > 1:
            errors.append(f"actor_rollout_ref.{role}.tensor_model_parallel_size={tp}: the {family} checkpoint loads "
                          "with its vision tower in this run (its data rows carry images), and rlsp's tensor "
                          "parallelism does not run a vision-language model; legal: 1 (use Ulysses / ring sequence "
                          "parallelism), or data without images (its text model then takes tp)")
    # a critic from the same model loads its tower too: rlsp.models.critic_vision names what it refuses


def check_vision_data(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """Rows with images need a vision-language model with its processor (a Qwen3.5 wrapper loads its tower for them)
    and data.image_patch_size null or the processor's; videos need torchvision (rlsp.data.vision_processor)."""
    path = cfg.actor_rollout_ref.model.path
    files = data_files(cfg)
    errors += vision_data_errors("actor_rollout_ref.model.path", path, files)
    errors += image_patch_size_errors(cfg.data.image_patch_size, "actor_rollout_ref.model.path", path, files)
    if any(image_rows(file, "images") for file in files):
        errors += image_run_errors(cfg)


def check_router_replay(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """MoE routing replay R2 / R3 (verl's rollout switch included) where rlsp can run it (rlsp.engine.router_replay)."""
    errors += replay_config_errors(cfg.actor_rollout_ref, ctx.results["model_config"], agent_loops_enabled(cfg),
                                   bool(cfg.async_training.partial_rollout))


def check_router_aux(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """The MoE router auxiliary loss the model config asks for, model.override_config applied (rlsp.engine.router_aux)."""
    config = with_overrides(ctx.results["model_config"], cfg.actor_rollout_ref.model.override_config)
    errors += router_aux_errors(config, ctx.layout.role("actor") if ctx.layout is not None else None)


def check_expert_lora(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """LoRA on the fused experts (rlsp.models.lora_experts) is refused with expert parallelism."""
    model, ep = cfg.actor_rollout_ref.model, ctx.layout.role("actor").ep if ctx.layout is not None else 1
    if lora_enabled(model) and (problem := expert_parallel_lora_problem(ctx.results["model_config"], model, ep)):
        errors.append(f"actor_rollout_ref.model.{problem} (actor_rollout_ref.actor.fsdp_config.expert_parallel_size)")


def check_rollout_ep(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """The rollout engine's expert parallelism against the engine, the model and the device (rlsp.rollout.support)."""
    tp = ctx.layout.rollout_tp if ctx.layout is not None else 1
    errors += rollout_ep_errors(ctx.results["model_config"], cfg.actor_rollout_ref.rollout, ctx.device_type, tp)
