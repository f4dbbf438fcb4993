"""Preflight: checks that need the registries, the model config or files fail before workers have the run's config."""

import pytest
from omegaconf import OmegaConf

from rlsp.checks.preflight import preflight
from rlsp.config.schema import RLSPConfig


def make(tmp_path, **overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    OmegaConf.update(cfg, "trainer.cache_dir", str(tmp_path / "cache"))
    for key, val in overrides.items():
        OmegaConf.update(cfg, key, val)
    return cfg


def test_builtin_assets_resolve_to_local_files(tmp_path):
    cfg = preflight(make(tmp_path))
    assert cfg.actor_rollout_ref.model.path.startswith(str(tmp_path))
    assert cfg.data.train_files[0].endswith("train.parquet") and cfg.data.val_files[0].endswith("test.parquet")


@pytest.mark.parametrize(
    "key,val,needle",
    [
        ("algorithm.adv_estimator", "ppo2", "legal values: ['gae', 'gdpo', 'gpg', 'grpo'"),
        ("algorithm.gamma", 0.9, "algorithm.gamma=0.9 has no effect with algorithm.adv_estimator='grpo'"),
        ("algorithm.lam", 0.95, "pick an estimator that uses it: ['gae']"),
        ("actor_rollout_ref.actor.kl_loss_type", "k7", "kl_loss_type='k7' is not supported; legal values: ['k1', 'kl'"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "gspo2", "loss_mode='gspo2' is unknown; legal values: ["),
        ("data.max_response_length", 500, "exceeds the model's max_position_embeddings"),
        ("actor_rollout_ref.model.path", "/nonexistent/model", "is not a local directory"),
        ("data.train_files", "/nonexistent/train.parquet", "does not exist"),
        ("reward.custom_function_path", "/nonexistent/score.py", "custom reward file not found: /nonexistent/score.py"),
    ],
)
def test_bad_values_fail_with_the_value_named(tmp_path, key, val, needle):
    with pytest.raises(ValueError) as err:
        preflight(make(tmp_path, **{key: val}))
    assert needle in str(err.value)


def test_critic_path_checked_only_when_a_critic_is_built(tmp_path):
    bad = {"critic.model.path": "/nonexistent/critic"}
    preflight(make(tmp_path, **bad))  # GRPO: no critic, the key is unused
    with pytest.raises(ValueError, match="critic.model.path='/nonexistent/critic' is not a local directory"):
        preflight(make(tmp_path, **bad, **{"algorithm.adv_estimator": "gae"}))
    preflight(make(tmp_path, **{"algorithm.adv_estimator": "gae", "algorithm.gamma": 0.99, "algorithm.lam": 0.95}))


def test_tensor_parallel_degree_must_split_the_heads(tmp_path):
    from rlsp.models.tiny import TinyModelSpec, build_tiny_model

    path = build_tiny_model(TinyModelSpec(hidden_size=48, intermediate_size=64, num_attention_heads=6,
                                          num_key_value_heads=3), str(tmp_path / "m6q3kv"))
    with pytest.raises(ValueError) as err:
        preflight(make(tmp_path, **{"actor_rollout_ref.model.path": path, "actor_rollout_ref.rollout.name": "hf",
                                    "actor_rollout_ref.actor.tensor_model_parallel_size": 2}))
    text = str(err.value)
    assert "actor_rollout_ref.actor.tensor_model_parallel_size: tensor_model_parallel_size=2 does not divide 6 q heads" in text
    assert "actor_rollout_ref.ref.tensor_model_parallel_size" in text  # the reference inherits the actor's degree
    assert "legal tensor_model_parallel_size for this model: 1" in text
    preflight(make(tmp_path, **{"actor_rollout_ref.model.path": path, "actor_rollout_ref.rollout.name": "hf",
                                "actor_rollout_ref.actor.ring_sequence_parallel_size": 2}))  # ring: any heads
