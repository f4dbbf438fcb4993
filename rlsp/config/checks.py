"""The registry of start-up checks: every check a run makes before any worker has the run's config, by name and
stage, in the order it runs. `rlsp.main` and `rlsp.check` run each stage through `run_checks`, so a
command that `rlsp.check` passes is one that `rlsp.main` starts, and the other way round.

Stages (each check appends its messages to one list; a stage's messages are reported together):

    config     config values, no torch (`validate_config`): the key gate, verl's spellings, the `auto`
               keys (rlsp.config.auto: reads the model's config.json and the machine's memory), the layout
               (`rlsp.config.layout_build`), then every rlsp/config/validate_*.py check; registered here
    preflight  files and registries (data files, model config and tokenizer against the layout,
               estimator and loss names, reward model, teachers, agent tools, trackers); registered by
               rlsp/checks/preflight.py
    resume     the run dir: what the run continues from, refusing a checkpoint this command cannot
               load; registered by rlsp/checks/resume_check.py

A check is `fn(cfg, ctx, errors)`; `ctx` carries what earlier checks produced (the layout, the
device, the resume plan). Dependencies are declared, not left to the order: a check runs only when every
check it `needs` (earlier in the same stage) passed, so a missing model directory gives its one line rather
than a traceback from a check that read the tokenizer in it; and a check whose feature is off (`when`,
config only: agent loops, teachers, a reward model) neither runs nor loads anything. What was skipped, and
why, is in `ctx.results["skipped"]`. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlsp.config.auto import resolve_auto
from rlsp.config.layout import ParallelLayout
from rlsp.config.layout_build import build_layout
from rlsp.config.validate_agent import check_multi_turn
from rlsp.config.validate_async import check_off_policy
from rlsp.config.validate_bypass import check_bypass_mode
from rlsp.config.validate_core import (
    check_adaptive,
    check_algorithm,
    check_batches,
    check_choices,
    check_critic,
    check_ranges,
)
from rlsp.config.validate_dapo import check_dapo
from rlsp.config.validate_gpu_memory import check_gpu_memory
from rlsp.config.validate_keys import check_known_keys
from rlsp.config.validate_lora import check_lora, check_rollout_loading
from rlsp.config.validate_memory import check_memory_options
from rlsp.config.validate_offload import check_offload
from rlsp.config.validate_verl import check_verl_keys
from rlsp.config.verl_compat import apply_verl_spellings

STAGES = ("config", "preflight", "resume")
# Where each stage's checks are registered (imported by the entry points before they run the stage).
STAGE_MODULES = {"config": "rlsp.config.checks", "preflight": "rlsp.checks.preflight",
                 "resume": "rlsp.checks.resume_check"}


@dataclass
class CheckContext:
    """What the checks of a run share: the layout (None until built, or when its degrees are invalid),
    the device type the run will use, and results later steps read (e.g. the resume plan)."""

    layout: ParallelLayout | None = None
    device_type: str = "cpu"
    results: dict[str, Any] = field(default_factory=dict)


CheckFn = Callable[[Any, CheckContext, list[str]], None]


@dataclass(frozen=True)
class Check:
    name: str
    stage: str
    fn: CheckFn
    target: Callable[..., Any]  # the function doing the work (the validator `fn` adapts), for introspection
    needs_layout: bool = False  # skipped when the layout could not be built (its problems are reported)
    gate: bool = False  # its problems end the stage: the later checks would trip over them
    needs: tuple[str, ...] = ()  # checks of the same stage that must have passed: this one reads what they vouch for
    when: Callable[[Any], bool] | None = None  # whether the feature it checks is in use (None: always)

    def skip_reason(self, cfg: Any, ctx: CheckContext, passed: set[str]) -> str | None:
        """Why this check does not run now (None: it runs)."""
        if self.needs_layout and ctx.layout is None:
            return "the layout could not be built"
        if self.when is not None and not self.when(cfg):
            return "not in use"
        if unmet := [n for n in self.needs if n not in passed]:
            return f"needs {', '.join(unmet)}, which did not pass"
        return None


REGISTRY: dict[str, Check] = {}  # by name, in registration (= run) order within a stage


def register(name: str, stage: str, *, needs_layout: bool = False, gate: bool = False,
             target: Callable[..., Any] | None = None, needs: tuple[str, ...] = (),
             when: Callable[[Any], bool] | None = None) -> Callable[[CheckFn], CheckFn]:
    """Decorator registering `fn(cfg, ctx, errors)` as check `name` of `stage`; `needs` names checks of the
    same stage, registered before it, that must pass first; `when(cfg)` says whether its feature is in use."""
    if stage not in STAGES:
        raise ValueError(f"check {name!r}: stage={stage!r}; legal stages: {list(STAGES)}")
    earlier = [c.name for c in REGISTRY.values() if c.stage == stage and c.name != name]
    if unknown := [n for n in needs if n not in earlier]:
        raise ValueError(f"check {name!r} needs {unknown}, which are not {stage} checks registered before it; "
                         f"those are: {earlier}")

    def add(fn: CheckFn) -> CheckFn:
        if name in REGISTRY and REGISTRY[name].fn.__qualname__ != fn.__qualname__:
            raise ValueError(f"check {name!r} is registered twice ({REGISTRY[name].fn.__qualname__}, {fn.__qualname__})")
        REGISTRY[name] = Check(name, stage, fn, target or fn, needs_layout, gate, tuple(needs), when)
        return fn

    return add


def registered(stage: str) -> tuple[Check, ...]:
    """The checks of `stage` in run order."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}; legal stages: {list(STAGES)}")
    return tuple(c for c in REGISTRY.values() if c.stage == stage)


def run_checks(cfg: Any, stage: str, ctx: CheckContext) -> list[str]:
    """Run every registered check of `stage` on `cfg`; returns all their messages (empty: all passed)."""
    checks = registered(stage)
    if not checks:  # never a silent pass: the registering module was not imported
        raise RuntimeError(f"no {stage} checks are registered; import {STAGE_MODULES[stage]} first")
    errors: list[str] = []
    passed: set[str] = set()
    skipped = ctx.results.setdefault("skipped", {})
    for check in checks:
        if (why := check.skip_reason(cfg, ctx, passed)) is not None:
            skipped[check.name] = why
            continue
        before = len(errors)
        check.fn(cfg, ctx, errors)
        if len(errors) == before:
            passed.add(check.name)
        elif check.gate:
            break
    return errors


def _values(name: str, fn: Callable[[Any, list[str]], None]) -> None:
    """Register a validator `fn(cfg, errors)` of the config stage."""
    register(name, "config", target=fn)(lambda cfg, ctx, errors: fn(cfg, errors))


def _placed(name: str, fn: Callable[[Any, Any, list[str]], None], needs_layout: bool = False) -> None:
    """Register a validator `fn(cfg, layout, errors)` of the config stage."""
    register(name, "config", needs_layout=needs_layout, target=fn)(lambda cfg, ctx, errors: fn(cfg, ctx.layout, errors))


def _layout(cfg: Any, ctx: CheckContext, errors: list[str]) -> None:
    ctx.layout = build_layout(cfg, errors)


# The config stage, in order. Typos first: the other checks would trip over a misspelled section.
register("known_keys", "config", gate=True, target=check_known_keys)(lambda cfg, ctx, errors: check_known_keys(cfg, errors))
_values("verl_spellings", apply_verl_spellings)  # verl's spellings onto rlsp's keys, as composed configs get them
# `auto` keys decided from the model and the machine (before the layout: fsdp_size is one of its degrees);
# a gate: a value that is neither auto nor of its type would leave other keys undecided for the checks after it
# (a vision-language actor's image tokens per row: `ctx.results["image_tokens"]`, counted by the caller, rlsp.data.image_count)
register("auto", "config", gate=True, target=resolve_auto)(
    lambda cfg, ctx, errors: ctx.results.update(auto=resolve_auto(cfg, errors, None, ctx.results.get("image_tokens"))))
register("layout", "config", target=build_layout)(_layout)
_placed("adaptive_sp", check_adaptive, needs_layout=True)
_placed("batches", check_batches, needs_layout=True)
_placed("critic", check_critic, needs_layout=True)
_placed("memory_options", check_memory_options, needs_layout=True)
_values("algorithm", check_algorithm)
_values("choices", check_choices)
_values("ranges", check_ranges)
_values("off_policy", check_off_policy)
_values("bypass_mode", check_bypass_mode)
_placed("gpu_memory", check_gpu_memory)
_placed("offload", check_offload)
_placed("lora", check_lora)
_values("rollout_loading", check_rollout_loading)
_values("verl_keys", check_verl_keys)
_values("multi_turn", check_multi_turn)
_values("dapo", check_dapo)
