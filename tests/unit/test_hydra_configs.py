"""The shipped Hydra configs compose against the schema and pass validation; overrides are typed."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from rlsp.config.store import register_schema
from rlsp.config.validate import validate_config

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")


@pytest.fixture(autouse=True)
def hydra_dir():
    register_schema()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        yield


def test_demo_config_carries_tiny_model_values():
    cfg = compose(config_name="rlsp")
    validate_config(cfg)
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-3 and cfg.actor_rollout_ref.actor.entropy_coeff == 0.02


def test_grpo_config_uses_general_defaults():
    cfg = compose(config_name="grpo", overrides=["actor_rollout_ref.rollout.n=4"])
    validate_config(cfg)
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6 and cfg.actor_rollout_ref.rollout.n == 4


def test_unknown_key_is_refused():
    with pytest.raises(ConfigCompositionException):
        compose(config_name="rlsp", overrides=["actor_rollout_ref.actor.ulysses_sp=2"])
