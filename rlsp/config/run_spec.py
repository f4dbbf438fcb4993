"""RunSpec: what a checked config asks the run to do, resolved once; the runtime reads this, never a validator.

The validators (rlsp/config/validate_*.py) only check a config and report; the rules that turn a config into
what runs (which policy loss with which keyword arguments, which teachers, whether agent loops or a rollout pool
run, the overlong-shaping limit) live here, so the trainer, the workers and the algorithms import one place.
An import-linter contract (.importlinter) keeps every module outside rlsp.config off the validate_* modules.

`resolve_run_spec(cfg)` builds the frozen `RunSpec` of a config that `validate_config` accepted; every worker's
`RoleContext` holds it (rlsp/workers/context.py). The predicates (`agent_loops_enabled`, ...) are the same rules
for code that runs before a spec exists (the check pipeline's `when=` conditions). No torch import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from omegaconf import OmegaConf

from rlsp.config.schema_distill import DEFAULT_TEACHER, TeacherModelConfig
from rlsp.config.validate_policy_loss import policy_loss_kwargs


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher: its entry name, routing key (None: scores every row), model directory, compute dtype."""

    name: str
    key: str | None
    model_path: str
    dtype: str


@dataclass(frozen=True)
class RunSpec:
    """The resolved run (see the module docstring); built by `resolve_run_spec`."""

    policy_loss: str  # the registered policy loss the actor runs (bypass_mode's when that mode is on)
    policy_loss_kwargs: Mapping[str, Any]  # exactly that loss's keyword arguments (read-only)
    teachers: tuple[TeacherSpec, ...]  # empty without distillation
    agent_loops: bool  # rows run through agent loops (multi-turn, tools)
    rollout_pool: bool  # a separate rollout pool (async training)
    overlong_max_resp_len: int  # the hard limit of DAPO's overlong shaping

    @property
    def distillation(self) -> bool:
        return bool(self.teachers)


def resolve_run_spec(cfg: Any) -> RunSpec:
    """The RunSpec of `cfg` (call after `validate_config` has accepted it)."""
    name, kwargs = actor_policy_loss(cfg)
    return RunSpec(policy_loss=name, policy_loss_kwargs=MappingProxyType(dict(kwargs)),
                   teachers=tuple(teacher_specs(cfg)) if distillation_enabled(cfg) else (),
                   agent_loops=agent_loops_enabled(cfg), rollout_pool=rollout_pool_enabled(cfg),
                   overlong_max_resp_len=resolved_max_resp_len(cfg))


def agent_loops_enabled(cfg: Any) -> bool:
    """Agent loops run when `multi_turn.enable=true`, or when a verl command picks a loop without it
    (`agent.default_agent_loop` other than single_turn_agent, or `agent.agent_loop_config_path` set)."""
    r = cfg.actor_rollout_ref.rollout
    return bool(r.multi_turn.enable or r.agent.default_agent_loop != "single_turn_agent"
                or r.agent.agent_loop_config_path)


def rollout_pool_enabled(cfg: Any) -> bool:
    return int(cfg.rollout.n_gpus_per_node) > 0


def distillation_enabled(cfg: Any) -> bool:
    return bool(getattr(cfg, "distillation", None) is not None and cfg.distillation.enabled)


def resolved_max_resp_len(cfg: Any) -> int:
    """The overlong shaping's hard limit: reward.reward_kwargs.max_resp_len, or data.max_response_length when null."""
    value = cfg.reward.reward_kwargs.max_resp_len
    return int(cfg.data.max_response_length if value is None else value)


def rs_threshold(rc: Any) -> str | float | None:
    """`rollout_rs_threshold` as the rejection parser takes it: a number, None, or its string form."""
    threshold = rc.rollout_rs_threshold
    return threshold if isinstance(threshold, (int, float, type(None))) else str(threshold)


def actor_policy_loss(cfg: Any) -> tuple[str, dict[str, Any]]:
    """(registered policy loss, its keyword arguments) the actor runs: `policy_loss.loss_mode` with its keys,
    or under bypass_mode the "bypass_mode" loss with the PPO clip keys and the rollout-correction settings."""
    actor, rc = cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction
    kwargs = policy_loss_kwargs(actor)
    if not rc.bypass_mode:
        return actor.policy_loss.loss_mode, kwargs
    kwargs.update(loss_type=str(rc.loss_type), rollout_is=rc.rollout_is, rollout_is_threshold=float(rc.rollout_is_threshold),
                  rollout_is_batch_normalize=bool(rc.rollout_is_batch_normalize), rollout_rs=rc.rollout_rs,
                  rollout_rs_threshold=rs_threshold(rc))
    return "bypass_mode", kwargs


def configured_teachers(teachers: dict[str, Any]) -> dict[str, Any]:
    """verl's rule, kept: with several entries the default `teacher_model` entry is dropped -- but only when
    it is unconfigured (rlsp keeps a configured one instead of silently losing it)."""
    if len(teachers) > 1 and DEFAULT_TEACHER in teachers:
        default = teachers[DEFAULT_TEACHER]
        if default is not None and default.model_path is None and default.key is None:
            return {n: t for n, t in teachers.items() if n != DEFAULT_TEACHER}
    return teachers


def teacher_specs(cfg: Any) -> list[TeacherSpec]:
    """The configured teachers, in entry order."""
    d = cfg.distillation
    entries = {str(n): OmegaConf.merge(OmegaConf.structured(TeacherModelConfig), raw)
               for n, raw in d.teacher_models.items()}
    student = str(cfg.actor_rollout_ref.model.dtype)
    return [TeacherSpec(name, t.key, str(t.model_path), str(t.inference.dtype or student))
            for name, t in configured_teachers(entries).items()]
