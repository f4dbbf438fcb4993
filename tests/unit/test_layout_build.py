"""The run's layout is built once, by `build_layout` (via validate_config), with every field decided there:
each field checked against the value worked out by hand from the config, the layout frozen, and no
module of rlsp constructing or patching a ParallelLayout anywhere else."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
from omegaconf import OmegaConf

from rlsp.config.layout import REWARD_MODES, ParallelLayout, RoleLayout, World
from rlsp.config.layout_build import build_layout
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config

RLSP = pathlib.Path(__file__).resolve().parents[2] / "rlsp"
GRPO = {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.use_kl_loss": True, "algorithm.use_kl_in_reward": False,
        # FSDP over all ranks, as RoleLayout's default (the `auto` value is tests/unit/test_auto_settings.py's)
        **{f"{role}.fsdp_config.fsdp_size": -1 for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")}}
FOUR = {"trainer.n_gpus_per_node": 4, "data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8}


def _cfg(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {**GRPO, **overrides}.items():
        OmegaConf.update(cfg, key, val, force_add=True)
    return cfg


def _fields(layout: ParallelLayout) -> dict:
    return {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}


def _expected(policy: World, **fields) -> dict:
    """Every field of the layout: the given ones, the rest at what a plain GRPO run on `policy` has."""
    plain = {"policy": policy, "actor": RoleLayout(policy), "ref": RoleLayout(policy), "critic": None,
             "critic_colocated": True, "rollout": None, "rollout_tp": 1, "reward_model": None, "reward_mode": "rules",
             "teachers": False, "has_reference": True}
    return plain | fields


CASES = {
    "grpo, KL loss": ({}, _expected(World(1, 2))),
    "no KL anywhere: no reference": ({"actor_rollout_ref.actor.use_kl_loss": False},
                                     _expected(World(1, 2), has_reference=False)),
    "KL in the reward only": ({"actor_rollout_ref.actor.use_kl_loss": False, "algorithm.use_kl_in_reward": True},
                              _expected(World(1, 2), has_reference=True)),
    "ppo, critic in a pool of its own": (
        {"algorithm.adv_estimator": "gae", "critic.colocate": False, "critic.nnodes": 1, "critic.n_gpus_per_node": 1},
        _expected(World(1, 2), critic=RoleLayout(World(1, 1)), critic_colocated=False)),
    "ulysses 2 on 4 workers, rollout tp 2": (
        {**FOUR, "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2, "actor_rollout_ref.rollout.name": "vllm",
         "actor_rollout_ref.rollout.tensor_model_parallel_size": 2},
        _expected(World(1, 4), actor=RoleLayout(World(1, 4), ulysses=2), ref=RoleLayout(World(1, 4), ulysses=2),
                  rollout_tp=2)),
    "rollout pool of its own, tp 2": (
        {**FOUR, "rollout.n_gpus_per_node": 2, "actor_rollout_ref.rollout.name": "vllm",
         "actor_rollout_ref.rollout.tensor_model_parallel_size": 2, "async_training.require_batches": 1},
        _expected(World(1, 4), rollout=World(1, 2), rollout_tp=2)),
    "rule scoring in 3 processes": ({"reward_model.num_workers": 3}, _expected(World(1, 2), reward_mode="rules")),
    "reward model, FSDP, ulysses 2": (
        {"reward_model.enable": True, "reward_model.model.path": "/rm", "reward_model.ulysses_sequence_parallel_size": 2},
        _expected(World(1, 2), reward_model=RoleLayout(World(1, 2), ulysses=2), reward_mode="model_fsdp")),
    "reward loop in the policy workers": (
        {"reward_model.enable": True, "reward_model.model.path": "/rm", "reward_model.use_reward_loop": True},
        _expected(World(1, 2), reward_model=RoleLayout(World(1, 2), tp=1), reward_mode="model_vllm")),
    "reward loop beside a tp-2 rollout engine": (
        {"reward_model.enable": True, "reward_model.model.path": "/rm", "reward_model.use_reward_loop": True,
         "actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size": 2},
        _expected(World(1, 2), rollout_tp=2, reward_model=RoleLayout(World(1, 2), tp=1), reward_mode="model_servers")),
    "distillation teachers": (
        {"distillation.enabled": True, "distillation.teacher_models.teacher_model.model_path": "/teacher"},
        _expected(World(1, 2), teachers=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_field_of_the_built_layout(name):
    overrides, expected = CASES[name]
    cfg = _cfg(**overrides)
    layout = validate_config(cfg)
    assert _fields(layout) == expected
    errors: list[str] = []
    assert build_layout(cfg, errors) == layout and errors == []  # the builder alone gives the same object


def test_derived_placement_follows_the_fields():
    layout = validate_config(_cfg(**CASES["reward loop beside a tp-2 rollout engine"][0]))
    assert layout.reward_servers and layout.roles_of("policy") == ("actor", "ref", "rollout")
    layout = validate_config(_cfg(**CASES["reward loop in the policy workers"][0]))
    assert not layout.reward_servers and layout.roles_of("policy") == ("actor", "ref", "rollout", "reward_model")


def test_invalid_degrees_give_no_layout_and_name_the_key():
    errors: list[str] = []
    assert build_layout(_cfg(**{"trainer.n_gpus_per_node": 0}), errors) is None
    assert errors == ["trainer.nnodes=1 and trainer.n_gpus_per_node=0 must be >= 1"]


def test_layout_is_frozen_and_its_reward_mode_checked():
    layout = validate_config(_cfg())
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.has_reference = False  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"reward_mode='remote'; legal values: \['rules', 'model_fsdp'"):
        ParallelLayout(World(1, 1), RoleLayout(World(1, 1)), RoleLayout(World(1, 1)), reward_mode="remote")
    with pytest.raises(ValueError, match="does not match reward_model=None"):
        ParallelLayout(World(1, 1), RoleLayout(World(1, 1)), RoleLayout(World(1, 1)), reward_mode="model_fsdp")
    assert REWARD_MODES == ("rules", "model_fsdp", "model_vllm", "model_servers")


def test_no_module_builds_or_patches_a_layout_elsewhere():
    """Only rlsp/config/layout_build.py constructs a ParallelLayout; nothing calls dataclasses.replace on one,
    and the old re-decision of the reference (needs_reference) is gone."""
    constructors, patches, redecided = [], [], []
    for path in RLSP.rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(RLSP.parent).as_posix()
        if re.search(r"\bParallelLayout\(", text) and rel != "rlsp/config/layout_build.py":
            constructors.append(rel)
        if re.search(r"replace\(\s*(self\.|ctx\.)?layout\b", text):
            patches.append(rel)
        if "needs_reference" in text:
            redecided.append(rel)
    assert (constructors, patches, redecided) == ([], [], [])
