"""The preflight stage of the check registry (rlsp.config.checks): checks that need more than config
arithmetic — registries, the model's config, data files, trackers — run in the driver before any
worker starts, so a bad run fails in seconds with a clear message. Each is registered here, in run order.

`preflight(cfg, layout)` resolves built-in assets and raises one error listing every problem; `rlsp.check`
runs the same stage (`resolve_assets`, then `preflight_errors`) to collect them alongside its own report.
"""

from __future__ import annotations

import json
import os
from typing import Any

from omegaconf import DictConfig

from rlsp.algos.registry import list_adv_estimators, list_policy_losses
from rlsp.config.checks import CheckContext, register, run_checks
from rlsp.config.layout import CRITIC_ESTIMATORS, ParallelLayout
from rlsp.config.run_spec import agent_loops_enabled, distillation_enabled
from rlsp.config.validate import validate_config
from rlsp.controller.ray_session import launcher_problem
from rlsp.data.vision_processor import image_rows, image_run_errors, vision_data_errors
from rlsp.engine.router_aux import router_aux_errors, with_overrides
from rlsp.engine.router_replay import replay_config_errors
from rlsp.models.feature_support import run_feature_errors
from rlsp.models.loading import (
    TEXT_WRAPPERS,
    check_ring_support,
    check_sp_support,
    check_tp_windowed,
    read_model_config,
    tokenizer_problem,
)
from rlsp.parallel.ep_checks import check_ep_support
from rlsp.parallel.tp_checks import check_tp_support
from rlsp.rewards.loader import load_custom_reward_fn
from rlsp.rollout.support import check_rollout_support
from rlsp.trainer.assets import copy_to_shm, resolve_data_files, resolve_model_path
from rlsp.trainer.distill import teacher_vocab_problems
from rlsp.trainer.estimator_inputs import estimator_errors
from rlsp.trainer.off_policy import check_rollout_correction_names
from rlsp.trainer.preflight_agent import agent_errors
from rlsp.trainer.preflight_reward import reward_input_errors, reward_model_errors, reward_model_in_use
from rlsp.trainer.trackers import check_trackers
from rlsp.utils.device import resolve_device_type
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.preflight")


@register("data_files", "preflight")
def _check_data_files(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    for f in list(cfg.data.train_files) + list(cfg.data.val_files or []):
        if not os.path.exists(f):
            errors.append(f"data file {f!r} does not exist")
    if not cfg.data.train_files:
        errors.append("data.train_files is empty; give at least one parquet file")


@register("ray_launcher", "preflight")
def _check_ray_launcher(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    if (problem := launcher_problem(cfg)) is not None:
        errors.append(problem)


@register("names", "preflight")
def _check_names(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    actor = cfg.actor_rollout_ref.actor
    for key, val, legal in (
        ("algorithm.adv_estimator", cfg.algorithm.adv_estimator, list_adv_estimators()),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, list_policy_losses()),
    ):
        if val not in legal:
            errors.append(f"{key}={val!r} is unknown; legal values: {legal}")
    if cfg.algorithm.adv_estimator in list_adv_estimators():
        _check_estimator_settings(cfg, errors)
    check_rollout_correction_names(cfg, errors)


def _check_estimator_settings(cfg: DictConfig, errors: list[str]) -> None:
    """A setting the chosen estimator does not read must stay at its default: never silently ignored;
    and what the estimator needs from the run must be there (rlsp.trainer.estimator_inputs)."""
    errors += estimator_errors(cfg)


def _check_degrees(config: Any, layout: ParallelLayout, errors: list[str]) -> None:
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


@register("model_dir", "preflight")
def _check_model_dir(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """A local directory whose config.json transformers reads: every check of the model needs it."""
    key, path = "actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path
    if not os.path.isdir(path):
        errors.append(f"{key}={path!r} is not a local directory with a Hugging Face model "
                      "(nor a .gguf file or a directory holding one)")
        return
    try:
        ctx.results["model_config"] = read_model_config(key, path)
    except ValueError as exc:
        errors.append(str(exc))


@register("tokenizer", "preflight", needs=("model_dir",))
def _check_tokenizer(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """The trainer tokenizes prompts and decodes responses with the model directory's tokenizer."""
    if missing := tokenizer_problem("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path):
        errors.append(missing)


@register("model", "preflight", needs=("model_dir",))
def _check_model(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """The model against the run: the degrees of the layout, the rollout engine, the sequence length."""
    layout, device_type, config = ctx.layout, ctx.device_type, ctx.results["model_config"]
    if layout is not None:
        _check_degrees(config, layout, errors)
    else:  # the config's degrees are invalid (validate_config names them): the family itself, at degree 1
        try:
            check_sp_support(config, 1)
        except ValueError as exc:
            errors.append(f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path!r}: {exc}")
    rollout_error = check_rollout_support(config, cfg.actor_rollout_ref.rollout.name, device_type,
                                          layout.rollout_tp if layout is not None else 1)
    if rollout_error:
        errors.append(rollout_error)
    _check_text_only_data(cfg, errors)
    errors += run_feature_errors(cfg, config)
    need = cfg.data.max_prompt_length + cfg.data.max_response_length
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and need > limit:
        errors.append(f"data.max_prompt_length + data.max_response_length = {need} exceeds the model's "
                      f"max_position_embeddings={limit}")


def _own_critic(cfg: DictConfig) -> bool:
    return cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS and bool(cfg.critic.model.path)


@register("critic_model", "preflight", when=_own_critic)
def _check_critic(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """A critic with a model of its own (critic.model.path) needs a readable model directory there."""
    path = cfg.critic.model.path
    if not os.path.isdir(path):
        errors.append(f"critic.model.path={path!r} is not a local directory with a Hugging Face model "
                      "(leave it unset to initialise the critic from the actor's checkpoint)")
        return
    try:
        read_model_config("critic.model.path", path)
    except ValueError as exc:
        errors.append(str(exc))


def _check_text_only_data(cfg: DictConfig, errors: list[str]) -> None:
    """A vision-language checkpoint rlsp trains text-only (qwen3_5 / qwen3_5_moe): rows with images or videos would
    be trained on their text alone, so they are refused (part of the `model` check)."""
    import pyarrow.parquet as pq  # noqa: PLC0415 -- only this check reads columns

    path = cfg.actor_rollout_ref.model.path
    with open(os.path.join(path, "config.json")) as f:
        family = json.load(f).get("model_type")
    if family not in TEXT_WRAPPERS:
        return
    for file in list(cfg.data.train_files) + list(cfg.data.val_files or []):
        names = pq.ParquetFile(file).schema_arrow.names if file.endswith(".parquet") and os.path.isfile(file) else []
        for key, column in (("data.image_key", "images"), ("data.video_key", "videos")):
            if column in names and any(v is not None and len(v) for v in pq.read_table(file, columns=[column])
                                       .column(column).to_pylist()):
                errors.append(f"{key}={column!r}: rows of {file!r} carry {column}, and actor_rollout_ref.model.path="
                              f"{path!r} is a {family} (vision-language) checkpoint that rlsp trains text-only (its "
                              "text model: the trainer, the hf rollout engine and the export load it without its tower; "
                              "rlsp.models.vision_lm trains it with images only when loaded with load_causal_lm(..., "
                              "vision_tower=True); images are read for qwen2_5_vl, qwen3_vl and qwen3_vl_moe); "
                              "legal: a dataset without "
                              f"{column} in its rows")


@register("vision_data", "preflight", needs=("model_dir",))
def _check_vision_data(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """Rows with images need a vision-language model with its processor; videos need torchvision
    (rlsp.data.vision_processor). Qwen3.5 wrappers, trained text-only, are `_check_text_only_data`'s."""
    path = cfg.actor_rollout_ref.model.path
    with open(os.path.join(path, "config.json")) as f:
        if json.load(f).get("model_type") in TEXT_WRAPPERS:
            return
    files = list(cfg.data.train_files) + list(cfg.data.val_files or [])
    errors += vision_data_errors("actor_rollout_ref.model.path", path, files)
    if any(image_rows(file, "images") for file in files):
        errors += image_run_errors(cfg)


@register("router_replay", "preflight", needs=("model_dir",))
def _check_router_replay(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """MoE routing replay R2 / R3 (verl's rollout switch included) where rlsp can run it (rlsp.engine.router_replay)."""
    errors += replay_config_errors(cfg.actor_rollout_ref, ctx.results["model_config"], agent_loops_enabled(cfg),
                                   bool(cfg.async_training.partial_rollout))


@register("router_aux", "preflight", needs=("model_dir",))
def _check_router_aux(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """The MoE router auxiliary loss the model config asks for, model.override_config applied (rlsp.engine.router_aux)."""
    config = with_overrides(ctx.results["model_config"], cfg.actor_rollout_ref.model.override_config)
    errors += router_aux_errors(config, ctx.layout.role("actor") if ctx.layout is not None else None)


def resolve_assets(cfg: DictConfig) -> None:
    """Built-in models and datasets (`builtin://`, GGUF files) into local paths, in place."""
    cache = cfg.trainer.cache_dir
    cfg.actor_rollout_ref.model.path = resolve_model_path(cfg.actor_rollout_ref.model.path, cache)
    if cfg.critic.model.path and cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS:
        cfg.critic.model.path = resolve_model_path(cfg.critic.model.path, cache)
    cfg.data.train_files = resolve_data_files(cfg.data.train_files, cache)
    cfg.data.val_files = resolve_data_files(cfg.data.val_files, cache) or None


def preflight(cfg: DictConfig, layout: ParallelLayout | None = None) -> DictConfig:
    """Resolve built-in assets into local paths (in place) and run the preflight stage; `layout` is the
    run's (from `validate_config`; built here when not given)."""
    resolve_assets(cfg)
    layout = layout if layout is not None else validate_config(cfg)
    errors = preflight_errors(cfg, layout, resolve_device_type(cfg.trainer.device))
    if errors:
        raise ValueError("invalid rlsp config:\n  - " + "\n  - ".join(errors))
    if cfg.actor_rollout_ref.model.use_shm:  # after the checks: nothing is copied for a refused run
        cfg.actor_rollout_ref.model.path = copy_to_shm(cfg.actor_rollout_ref.model.path)
    return cfg


def preflight_errors(cfg: DictConfig, layout: ParallelLayout | None, device_type: str,
                     skipped: dict[str, str] | None = None) -> list[str]:
    """Every problem the preflight stage finds with the (resolved) files, names and model of `cfg` on
    `device_type`; `layout` None skips the checks of parallel degrees against the model. `skipped` receives
    the checks that did not run, with the reason."""
    ctx = CheckContext(layout, device_type)
    errors = run_checks(cfg, "preflight", ctx)
    if skipped is not None:
        skipped.update(ctx.results["skipped"])
    return errors


@register("custom_reward", "preflight")
def _check_custom_reward(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    if cfg.reward.custom_function_path:
        try:
            load_custom_reward_fn(cfg.reward.custom_function_path, cfg.reward.custom_function_name)
        except (ValueError, RuntimeError, FileNotFoundError, AttributeError, TypeError) as exc:
            errors.append(str(exc))


@register("reward_model", "preflight", when=reward_model_in_use)
def _check_reward_model(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    errors += reward_model_errors(cfg, ctx.layout)


@register("reward_model_inputs", "preflight", needs=("reward_model", "tokenizer"), when=reward_model_in_use)
def _check_reward_model_inputs(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """The rows the legacy reward-model worker gets, against the policy's tokenizer."""
    errors += reward_input_errors(cfg, lambda: policy_tokenizer(cfg, ctx, errors))


@register("teachers", "preflight", needs=("tokenizer",), when=distillation_enabled)
def _check_teachers(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    if (tokenizer := policy_tokenizer(cfg, ctx, errors)) is not None:  # teachers score the student's token ids
        errors += teacher_vocab_problems(cfg, tokenizer)


@register("agent", "preflight", needs=("tokenizer",), when=agent_loops_enabled)
def _check_agent(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    if (tokenizer := policy_tokenizer(cfg, ctx, errors)) is not None:
        errors += agent_errors(cfg, tokenizer)


@register("trackers", "preflight")
def _check_trackers(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    try:
        check_trackers(list(cfg.trainer.logger))  # unknown names and missing libraries
    except ValueError as exc:
        errors.append(str(exc))


def policy_tokenizer(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> Any | None:
    """The policy's tokenizer, loaded once for the checks that read it (after the `tokenizer` check found its
    files); files that do not load are named once, and the checks that wanted it skip their part (None)."""
    if "policy_tokenizer" not in ctx.results:
        from transformers import AutoTokenizer  # noqa: PLC0415 -- only runs that use a tokenizer-reading feature

        path = cfg.actor_rollout_ref.model.path
        try:
            ctx.results["policy_tokenizer"] = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            errors.append(f"actor_rollout_ref.model.path={path!r}: its tokenizer files do not load "
                          f"({type(exc).__name__}: {first})")
            ctx.results["policy_tokenizer"] = None
    return ctx.results["policy_tokenizer"]
