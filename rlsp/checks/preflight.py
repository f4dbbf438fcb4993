"""The preflight stage of the check registry (rlsp.config.checks): checks that need more than config
arithmetic — registries, the model's config, data files, trackers — run in the driver before any
worker starts, so a bad run fails in seconds with a clear message. Each is registered here, in run order.

`preflight(cfg, layout)` resolves built-in assets and raises one error listing every problem; `rlsp.check`
runs the same stage (`resolve_assets`, then `preflight_errors`) to collect them alongside its own report.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

from rlsp.algos.registry import list_adv_estimators, list_policy_losses
from rlsp.checks.preflight_agent import agent_errors
from rlsp.checks.preflight_model import (
    check_expert_lora,
    check_rollout_ep,
    check_router_aux,
    check_router_replay,
    check_vision_data,
    check_wrapper_tower,
    degree_errors,
)
from rlsp.checks.preflight_reward import reward_input_errors, reward_model_errors, reward_model_in_use
from rlsp.config.checks import CheckContext, register, run_checks
from rlsp.config.layout import CRITIC_ESTIMATORS, ParallelLayout
from rlsp.config.run_spec import agent_loops_enabled, distillation_enabled
from rlsp.config.validate import validate_config
from rlsp.controller.ray_session import launcher_problem
from rlsp.models.family_checks import check_sp_support
from rlsp.models.feature_support import run_feature_errors
from rlsp.models.loading import read_model_config, tokenizer_problem
from rlsp.rewards.loader import load_custom_reward_fn
from rlsp.rollout.support import check_rollout_support
from rlsp.run.assets import copy_to_shm, resolve_data_files, resolve_model_path
from rlsp.run.trackers import check_trackers
from rlsp.step.distill import teacher_vocab_problems
from rlsp.step.estimator_inputs import estimator_errors
from rlsp.step.off_policy import check_rollout_correction_names
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
    and what the estimator needs from the run must be there (rlsp.step.estimator_inputs)."""
    errors += estimator_errors(cfg)


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
        degree_errors(config, layout, errors)
    else:  # the config's degrees are invalid (validate_config names them): the family itself, at degree 1
        try:
            check_sp_support(config, 1)
        except ValueError as exc:
            errors.append(f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path!r}: {exc}")
    rollout_error = check_rollout_support(config, cfg.actor_rollout_ref.rollout.name, device_type,
                                          layout.rollout_tp if layout is not None else 1)
    if rollout_error:
        errors.append(rollout_error)
    check_wrapper_tower(cfg, layout, errors)
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


# Checks of the model against the data and the MoE settings (rlsp.checks.preflight_model), registered here in order.
register("vision_data", "preflight", needs=("model_dir",))(check_vision_data)
register("router_replay", "preflight", needs=("model_dir",))(check_router_replay)
register("router_aux", "preflight", needs=("model_dir",))(check_router_aux)
register("expert_lora", "preflight", needs=("model_dir",))(check_expert_lora)
register("rollout_ep", "preflight", needs=("model_dir",))(check_rollout_ep)


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
