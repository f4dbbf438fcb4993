"""The one check pipeline (rlsp.config.checks): every validate_* check is reachable from a registered check,
stages are run in full or refused loudly, and rlsp.main and rlsp.check run exactly the same registered list."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import re

import pytest
from omegaconf import OmegaConf

import rlsp.checks.preflight  # noqa: F401 -- registers the preflight stage
import rlsp.checks.resume_check  # noqa: F401 -- registers the resume stage
from rlsp import main as rlsp_main
from rlsp.check import run_checks as check_command
from rlsp.config import checks
from rlsp.config.compose import compose_config
from rlsp.config.schema import RLSPConfig

CONFIG = pathlib.Path(__file__).resolve().parents[2] / "rlsp" / "config"
CALL = re.compile(r"\b(check_\w+|build_layout|apply_verl_spellings)\(")


def _reachable() -> set[str]:
    """Qualified names of the functions the registered checks run, followed call by call through rlsp."""
    seen: set[str] = set()
    todo = [c.target for c in checks.REGISTRY.values()]
    while todo:
        fn = todo.pop()
        name = f"{fn.__module__}.{fn.__name__}"
        if name in seen:
            continue
        seen.add(name)
        for called in CALL.findall(inspect.getsource(fn)):
            target = fn.__globals__.get(called)
            if callable(target) and getattr(target, "__module__", "").startswith("rlsp."):
                todo.append(target)
    return seen


def test_every_validator_check_is_registered_or_run_by_one():
    validators = []
    for path in sorted(CONFIG.glob("validate_*.py")):
        module = importlib.import_module(f"rlsp.config.{path.stem}")
        validators += [f"{module.__name__}.{name}" for name, fn in vars(module).items()
                       if name.startswith("check_") and inspect.isfunction(fn) and fn.__module__ == module.__name__]
    assert len(validators) >= 20  # the scan found them (a glob or import mistake would find none)
    missing = sorted(set(validators) - _reachable())
    assert missing == []
    # e.g. check_bypass_mode: config values only, a config-stage check of its own
    assert "rlsp.config.validate_bypass.check_bypass_mode" in _reachable()


def test_stages_and_their_order():
    names = {stage: [c.name for c in checks.registered(stage)] for stage in checks.STAGES}
    # the key gate, verl's spellings, the `auto` keys (fsdp_size is a degree of the layout), then the layout
    assert names["config"][:4] == ["known_keys", "verl_spellings", "auto", "layout"]
    assert names["preflight"] == ["data_files", "ray_launcher", "names", "model_dir", "tokenizer", "model", "critic_model",
                                  "vision_data", "router_replay", "router_aux", "expert_lora", "rollout_ep", "custom_reward", "reward_model", "reward_model_inputs", "teachers", "agent",
                                  "trackers"]
    assert names["resume"] == ["resume"]
    with pytest.raises(ValueError, match=r"stage='runtime'; legal stages: \['config', 'preflight', 'resume'\]"):
        checks.registered("runtime")
    with pytest.raises(ValueError, match="legal stages"):
        checks.register("x", "later")


def test_a_stage_without_checks_is_refused(monkeypatch):
    monkeypatch.setattr(checks, "REGISTRY", {k: v for k, v in checks.REGISTRY.items() if v.stage != "resume"})
    with pytest.raises(RuntimeError, match="no resume checks are registered; import rlsp.checks.resume_check"):
        checks.run_checks(None, "resume", checks.CheckContext())


def test_the_key_gate_stops_the_config_stage():
    bad = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(RLSPConfig)))  # a plain config: any key
    bad.trainer.no_such_key = 1
    ctx = checks.CheckContext()
    errors = checks.run_checks(bad, "config", ctx)
    assert len(errors) == 1 and "trainer.no_such_key" in errors[0] and ctx.layout is None  # nothing after the gate


def _spy(monkeypatch, registry: dict[str, checks.Check]) -> dict[str, list[str]]:
    """Record the name of each check `registry` holds as it runs (the checks themselves run as they are)."""
    ran: dict[str, list[str]] = {stage: [] for stage in checks.STAGES}

    def wrap(check: checks.Check) -> checks.Check:
        def fn(cfg, ctx, errors):
            ran[check.stage].append(check.name)
            check.fn(cfg, ctx, errors)
        return dataclasses.replace(check, fn=fn)

    monkeypatch.setattr(checks, "REGISTRY", {name: wrap(c) for name, c in registry.items()})
    return ran


def test_rlsp_main_and_rlsp_check_run_the_same_registered_list(tmp_path, monkeypatch):
    overrides = [f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path / 'cache'}",
                 "trainer.total_training_steps=2"]
    registry = dict(checks.REGISTRY)
    ran_check = _spy(monkeypatch, registry)
    report = check_command(overrides)
    assert report.problems == []
    ran_main = _spy(monkeypatch, registry)
    cfg = compose_config(overrides=overrides)
    layout = rlsp_main.validate_config(cfg)
    rlsp_main._prepare_checked(cfg, layout)  # preflight, the datasets, the resume stage: everything before Ray
    # every check of the stage but those whose feature is off (a reward model, teachers, agent loops, a critic
    # with its own model): those load nothing
    off = {"critic_model", "reward_model", "reward_model_inputs", "teachers", "agent"}
    every = {stage: [c.name for c in registry.values() if c.stage == stage and c.name not in off]
             for stage in checks.STAGES}
    assert ran_main == ran_check == every


def _toy_registry(monkeypatch, fail: set[str]) -> list[str]:
    """A preflight stage of four checks: b needs a, c needs b, d needs nothing and is off unless cfg.d;
    the names in `fail` report a problem. Returns the names that ran."""
    monkeypatch.setattr(checks, "REGISTRY", {})
    ran: list[str] = []

    def check(name):
        def fn(cfg, ctx, errors):
            ran.append(name)
            if name in fail:
                errors.append(f"{name} failed")
        return fn

    checks.register("a", "preflight")(check("a"))
    checks.register("b", "preflight", needs=("a",))(check("b"))
    checks.register("c", "preflight", needs=("b",))(check("c"))
    checks.register("d", "preflight", when=lambda cfg: cfg["d"])(check("d"))
    return ran


@pytest.mark.parametrize(("fail", "d_on", "ran", "skipped"), [
    (set(), True, ["a", "b", "c", "d"], {}),
    ({"a"}, True, ["a", "d"], {"b": "needs a, which did not pass", "c": "needs b, which did not pass"}),
    ({"b"}, False, ["a", "b"], {"c": "needs b, which did not pass", "d": "not in use"}),
])
def test_a_check_runs_only_when_what_it_needs_passed_and_its_feature_is_on(monkeypatch, fail, d_on, ran, skipped):
    got = _toy_registry(monkeypatch, fail)
    ctx = checks.CheckContext()
    errors = checks.run_checks({"d": d_on}, "preflight", ctx)
    assert got == ran and errors == [f"{n} failed" for n in ran if n in fail]
    assert ctx.results["skipped"] == skipped


def test_a_dependency_must_be_a_check_registered_before(monkeypatch):
    _toy_registry(monkeypatch, set())
    with pytest.raises(ValueError, match=r"check 'e' needs \['later'\], which are not preflight checks registered "
                                         r"before it; those are: \['a', 'b', 'c', 'd'\]"):
        checks.register("e", "preflight", needs=("later",))
    with pytest.raises(ValueError, match="not resume checks"):
        checks.register("f", "resume", needs=("a",))
