"""Config validation: legal defaults pass; each bad value fails naming itself and the legal choices."""

import pytest
from omegaconf import OmegaConf

from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config


def make(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in overrides.items():
        OmegaConf.update(cfg, key, val)
    return cfg


def test_defaults_are_valid():
    layout = validate_config(make())
    assert (layout.world_size, layout.actor.sp_size, layout.dp_size) == (2, 1, 2)


def test_sp_must_divide_world_and_lists_legal_values():
    with pytest.raises(ValueError) as err:
        validate_config(make(**{"trainer.n_gpus_per_node": 6, "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 4}))
    msg = str(err.value)
    assert "ulysses_sequence_parallel_size=4" in msg and "[1, 2, 3, 6]" in msg


def test_sp_layout():
    layout = validate_config(make(**{"trainer.n_gpus_per_node": 4, "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
                                     "data.train_batch_size": 16, "actor_rollout_ref.actor.ppo_mini_batch_size": 8}))
    assert (layout.dp_size, layout.actor.sp_size) == (2, 2)


@pytest.mark.parametrize(
    "key,val,needle",
    [
        ("data.train_batch_size", 3, "divisible by the 2 workers"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", 5, "legal values: [1, 2, 4, 8, 16]"),
        ("trainer.device", "tpu", "legal values: ['auto', 'cpu', 'cuda']"),
        ("actor_rollout_ref.rollout.name", "sglang", "legal values: ['vllm', 'hf']"),
        ("actor_rollout_ref.actor.clip_ratio_c", 0.5, "must be > 1"),
        ("actor_rollout_ref.rollout.temperature", 0.0, "must be > 0"),
        ("actor_rollout_ref.rollout.n", 0, "must be >= 1"),
        ("trainer.logger", ["console", "neptune"], "'neptune'"),
    ],
)
def test_bad_values_are_named(key, val, needle):
    with pytest.raises(ValueError) as err:
        validate_config(make(**{key: val}))
    assert key.split(".")[-1] in str(err.value)
    assert needle in str(err.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ValueError) as err:
        validate_config(make(**{"trainer.device": "tpu", "actor_rollout_ref.rollout.top_p": 2.0}))
    assert "trainer.device" in str(err.value) and "top_p" in str(err.value)


def test_fsdp_size_must_be_minus_one_or_divide_the_world():
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.trainer.n_gpus_per_node = 4
    cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size = 2
    cfg.actor_rollout_ref.ref.fsdp_config.fsdp_size = 1
    validate_config(cfg)  # HSDP layouts are legal
    cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size = 3
    cfg.actor_rollout_ref.ref.fsdp_config.fsdp_size = 0
    with pytest.raises(ValueError) as err:
        validate_config(cfg)
    assert "actor_rollout_ref.actor.fsdp_config.fsdp_size=3" in str(err.value)
    assert "actor_rollout_ref.ref.fsdp_config.fsdp_size=0" in str(err.value)
    assert "legal values -1, [1, 2, 4]" in str(err.value)
