"""async_training.*, rollout.* and algorithm.rollout_correction.*: what validation accepts, refuses
(naming the key and the way out) and the layout it returns."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlsp.config.layout import World
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.step.off_policy import check_rollout_correction_names, rollout_correction_settings, uses_rollout_logprobs
from rlsp.trainer.staleness import max_staleness, max_units_ahead

BASE = {"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.rollout.n": 2,
        "trainer.n_gpus_per_node": 1}


def _cfg(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {**BASE, **overrides}.items():
        OmegaConf.update(cfg, key.replace("__", "."), val)
    return cfg


def test_defaults_are_synchronous_without_a_pool() -> None:
    cfg = _cfg()
    layout = validate_config(cfg)
    assert layout.rollout is None and layout.roles_of("policy") == ("actor", "ref", "rollout")
    assert not rollout_correction_settings(cfg).enabled and not uses_rollout_logprobs(cfg)


def test_rollout_pool_layout() -> None:
    cfg = _cfg(**{"rollout.n_gpus_per_node": 2, "async_training.staleness_threshold": 1.0})
    layout = validate_config(cfg)
    assert layout.rollout == World(1, 2) and layout.total_workers == 3
    assert layout.roles_of("policy") == ("actor", "ref") and layout.roles_of("rollout") == ("rollout",)
    assert layout.world_of("rollout") == World(1, 2) and layout.role("rollout").world_size == 2
    assert "rollout own pool 1x2" in layout.describe()


@pytest.mark.parametrize("threshold,window,expected", [(0.0, 1, 0), (1.0, 1, 1), (0.0, 2, 1), (0.5, 2, 2),
                                                       (0.4, 2, 1), (2.0, 1, 2)])
def test_max_staleness(threshold, window, expected) -> None:
    cfg = _cfg(**{"async_training.staleness_threshold": threshold,
                  "async_training.trigger_parameter_sync_step": window})
    assert max_staleness(cfg) == expected


@pytest.mark.parametrize("threshold,window,batches,units,versions", [
    (0.0, 1, 2, 2, 0), (0.5, 1, 2, 3, 1), (0.25, 1, 2, 2, 0), (1.0, 2, 2, 8, 3), (0.0, 3, 2, 6, 2)])
def test_units_ahead_follow_verl(threshold, window, batches, units, versions) -> None:
    """floor((1 + staleness_threshold) x trigger x require_batches) units per sync window (verl's
    max_required_samples / ppo_mini_batch_size), and the version lag that allows."""
    cfg = _cfg(**{"async_training.staleness_threshold": threshold, "async_training.trigger_parameter_sync_step": window,
                  "async_training.require_batches": batches, "data.train_batch_size": 4 * batches})
    assert max_units_ahead(cfg) == units and max_staleness(cfg) == versions


def test_partial_rollout_is_accepted_with_a_pool() -> None:
    cfg = _cfg(**{"rollout.n_gpus_per_node": 1, "async_training.staleness_threshold": 0.5,
                  "async_training.partial_rollout": True, "async_training.partial_rollout_segment_tokens": 4})
    assert validate_config(cfg).rollout == World(1, 1)


REFUSED = [
    ({"async_training.partial_rollout": True}, "partial_rollout=true .* needs a rollout pool of its own"),
    ({"rollout.n_gpus_per_node": 1, "async_training.partial_rollout": True,
      "async_training.partial_rollout_segment_tokens": 0}, "partial_rollout_segment_tokens=0 must be >= 1"),
    ({"rollout.n_gpus_per_node": 2, "async_training.partial_rollout": True,
      "actor_rollout_ref.rollout.tensor_model_parallel_size": 2},
     "partial_rollout=true with actor_rollout_ref.rollout.tensor_model_parallel_size=2 is not supported"),
    ({"async_training.staleness_threshold": 0.5}, "needs a rollout pool of its own"),
    ({"async_training.trigger_parameter_sync_step": 0}, "trigger_parameter_sync_step=0 must be >= 1"),
    ({"rollout.n_gpus_per_node": 2, "async_training.require_batches": 2}, "require_batches=2 x .* must equal"),
    ({"rollout.n_gpus_per_node": 3}, "ppo_mini_batch_size=4 .* divisible by the 3 rollout workers"),
    ({"async_training.compute_prox_log_prob": True}, "only applies with async_training.use_rollout_log_probs=true"),
    ({"async_training.use_rollout_log_probs": True, "async_training.compute_prox_log_prob": True},
     "decoupled PPO.*set algorithm.rollout_correction.rollout_is=token"),
    ({"async_training.use_rollout_log_probs": True, "algorithm.rollout_correction.rollout_is": "token"},
     "ratio is 1"),
    ({"algorithm.rollout_correction.rollout_is": "geometric"}, "rollout_is='geometric' is not supported"),
    ({"algorithm.rollout_correction.rollout_rs_threshold": 2.0}, "has no effect without"),
    ({"algorithm.rollout_correction.rollout_is_batch_normalize": True}, "set algorithm.rollout_correction.rollout_is"),
]


@pytest.mark.parametrize("overrides,message", REFUSED)
def test_refused(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(**overrides))


def test_decoupled_and_bypass_are_accepted() -> None:
    decoupled = _cfg(**{"async_training.use_rollout_log_probs": True, "async_training.compute_prox_log_prob": True,
                        "algorithm.rollout_correction.rollout_is": "token"})
    validate_config(decoupled)
    assert not uses_rollout_logprobs(decoupled) and rollout_correction_settings(decoupled).rollout_is == "token"
    bypass = _cfg(**{"async_training.use_rollout_log_probs": True})
    validate_config(bypass)
    assert uses_rollout_logprobs(bypass)


def test_rejection_options_are_checked_by_name() -> None:
    errors: list[str] = []
    check_rollout_correction_names(_cfg(**{"algorithm.rollout_correction.rollout_rs": "token,seq_max_k2",
                                           "algorithm.rollout_correction.rollout_rs_threshold": 2.0}), errors)
    assert len(errors) == 1 and "'token' is verl's earlier name; use the current option 'token_k1'" in errors[0]
    errors.clear()
    check_rollout_correction_names(_cfg(**{"algorithm.rollout_correction.rollout_rs": "token_k1,seq_max_k2",
                                           "algorithm.rollout_correction.rollout_rs_threshold": "0.5_2.0,0.1"}), errors)
    assert errors == []
