"""optim.lr_scheduler_type (verl's constant and cosine schedules) and its keys: the factor of lr at every optimizer
step equals the closed form, the engine's scheduler applies it, and keys the constant schedule would not read are
refused by name, as are values out of range."""

from __future__ import annotations

import math

import pytest
import torch

from rlsp.config.compose import compose_config
from rlsp.config.validate import validate_config
from rlsp.engine.lr_schedule import Schedule, compute_lr_factor
from rlsp.engine.optim import OptimSettings, build_optimizer
from rlsp.workers.roles.common import optim_settings


def _cosine(t: int, warmup: int, total: int, floor: float, cycles: float) -> float:
    """The schedule written out: linear from 0 during the warm-up, then floor + (1 - floor) * (1 + cos) / 2."""
    if t < warmup:
        return t / warmup
    p = (t - warmup) / max(1, total - warmup)
    return max(floor, floor + (1 - floor) * 0.5 * (1 + math.cos(2 * math.pi * cycles * p)))


@pytest.mark.parametrize("zero_indexed", [True, False])
@pytest.mark.parametrize(("warmup", "floor", "cycles"), [(0, 0.0, 0.5), (3, 0.1, 0.5), (2, 0.0, 1.0)])
def test_cosine_factor_equals_the_closed_form(warmup, floor, cycles, zero_indexed):
    total = 20
    s = Schedule("cosine", warmup, total, floor, cycles, zero_indexed)
    for step in range(total + 3):
        t = step if zero_indexed else step + 1
        assert compute_lr_factor(s, step) == pytest.approx(_cosine(t, warmup, total, floor, cycles), abs=1e-15)
    half = Schedule("cosine", 0, 10, floor, 0.5)
    assert compute_lr_factor(half, 0) == 1.0 and compute_lr_factor(half, 10) == pytest.approx(floor, abs=1e-15)


def test_constant_factor_keeps_rlsps_warm_up():
    assert [compute_lr_factor(Schedule("constant", 4), k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert compute_lr_factor(Schedule("constant", 0), 0) == 1.0


def test_the_engine_scheduler_applies_the_factor():
    model = torch.nn.Linear(3, 2)
    s = OptimSettings(lr=0.5, schedule=Schedule("cosine", 2, 8, 0.2, 0.5))
    optimizer, scheduler = build_optimizer(model, s)
    seen = []
    for _ in range(9):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5 * _cosine(t, 2, 8, 0.2, 0.5) for t in range(9)], abs=1e-15)


def _cfg(*overrides: str):
    return compose_config(overrides=["trainer.total_training_steps=10", *overrides])


def test_the_config_reaches_the_optimizer_settings():
    cfg = _cfg("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
               "actor_rollout_ref.actor.optim.lr_warmup_steps=2")
    validate_config(cfg)
    s = optim_settings(cfg, "actor").schedule
    per_step = max(1, cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size) * \
        cfg.actor_rollout_ref.actor.ppo_epochs
    assert s == Schedule("cosine", 2 * per_step, 10 * per_step, 0.1, 0.5, True)
    old = _cfg("actor_rollout_ref.actor.optim.warmup_style=cosine")  # verl's deprecated spelling
    validate_config(old)
    assert optim_settings(old, "actor").schedule.kind == "cosine"


@pytest.mark.parametrize(("override", "words"), [
    ("actor_rollout_ref.actor.optim.lr_scheduler_type=linear",
     "actor_rollout_ref.actor.optim.lr_scheduler_type='linear' is not supported; legal values: ['constant', 'cosine']"),
    ("critic.optim.min_lr_ratio=0.2", "critic.optim.min_lr_ratio=0.2 only shape the cosine schedule and would have "
                                      "no effect with lr_scheduler_type=constant"),
    ("actor_rollout_ref.actor.optim.zero_indexed_step=false", "zero_indexed_step=False only shape the cosine"),
])
def test_bad_schedule_settings_are_refused_by_name(override, words):
    with pytest.raises(ValueError, match="invalid rlsp config") as info:
        validate_config(_cfg(override))
    assert words in str(info.value)


def test_out_of_range_and_contradicting_settings_are_refused():
    a = "actor_rollout_ref.actor.optim."
    with pytest.raises(ValueError) as info:
        validate_config(_cfg(f"{a}lr_scheduler_type=cosine", f"{a}min_lr_ratio=1.5", f"{a}num_cycles=0",
                             f"{a}total_training_steps=0"))
    text = str(info.value)
    for words in (f"{a}min_lr_ratio=1.5 must be in [0, 1]", f"{a}num_cycles=0.0 must be > 0",
                  f"{a}total_training_steps=0 must be -1 (the run's) or an integer >= 1"):
        assert words in text
    with pytest.raises(ValueError, match="warmup_style='constant' .* contradicts"):
        validate_config(_cfg(f"{a}lr_scheduler_type=cosine", f"{a}warmup_style=constant"))
