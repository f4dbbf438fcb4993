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


def test_ppo_config_builds_a_critic():
    cfg = compose(config_name="ppo")
    layout = validate_config(cfg)
    assert cfg.algorithm.adv_estimator == "gae" and layout.has_critic and layout.critic_colocated
    assert cfg.critic.optim.lr == 1e-3


def _recipe_overrides(script: Path) -> tuple[str, list[str]]:
    """The config name and key=value overrides of a recipe's `python -m rlsp.main` command."""
    import shlex

    text = script.read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if "rlsp.main" in x)
    tokens = shlex.split(line.replace("$MODEL", "/models/m").replace("$DATA", "/data/d").replace('"$@"', ""))
    name = tokens[tokens.index("--config-name") + 1] if "--config-name" in tokens else "rlsp"
    return name, [t for t in tokens if "=" in t]


@pytest.mark.parametrize("script", sorted((Path(CONFIGS).parent / "recipes").glob("*/run.sh")), ids=lambda p: p.parent.name)
def test_every_recipe_command_composes_and_validates(script):
    name, overrides = _recipe_overrides(script)
    layout = validate_config(compose(config_name=name, overrides=overrides))
    assert layout.has_critic == script.parent.name.startswith("ppo")
