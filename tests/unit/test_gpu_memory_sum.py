"""The GPU memory fractions of the vLLM engines awake together on one device (rlsp.config.validate_gpu_memory)."""

from __future__ import annotations

import pytest
from test_config import make

from rlsp.config.validate import validate_config

LOOP = {"reward_model.enable": True, "reward_model.model.path": "/rm", "reward_model.use_reward_loop": True}
AWAKE = {**LOOP, "reward_model.rollout.free_cache_engine": False}  # the reward engine never sleeps


def _fractions(rollout: float, reward: float, device: str = "cuda", **extra) -> dict:
    return {"trainer.device": device, "actor_rollout_ref.rollout.gpu_memory_utilization": rollout,
            "reward_model.rollout.gpu_memory_utilization": reward, **extra}


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_engines_awake_together_over_one_device_are_refused_with_the_numbers(device):
    with pytest.raises(ValueError) as err:
        validate_config(make(**AWAKE, **_fractions(0.5, 0.8, device)))
    msg = str(err.value)
    assert ("reward_model.rollout.gpu_memory_utilization=0.8 + actor_rollout_ref.rollout.gpu_memory_utilization=0.5"
            f" = 1.3 > 1 of a GPU (trainer.device={device})") in msg
    assert "lower reward_model.rollout.gpu_memory_utilization to <= 0.5" in msg
    assert "lower actor_rollout_ref.rollout.gpu_memory_utilization to <= 0.2" in msg
    assert "set reward_model.rollout.free_cache_engine=true" in msg
    assert "training state" in msg and "comes on top" in msg


def test_reward_servers_share_the_worker_gpu():
    """A reward engine in a process of its own (rollout tp 2, reward tp 1) still sits on the worker's GPU."""
    with pytest.raises(ValueError, match=r"in a process of its own beside each policy worker, on the worker's GPU"):
        validate_config(make(**AWAKE, **_fractions(0.6, 0.8, **{"actor_rollout_ref.rollout.tensor_model_parallel_size": 2})))


def test_fractions_that_fit_are_accepted():
    assert validate_config(make(**AWAKE, **_fractions(0.4, 0.5))).reward_model is not None
    assert validate_config(make(**AWAKE, **_fractions(0.5, 0.5))).reward_model is not None  # exactly the device


def test_cpu_runs_do_not_check_fractions():
    assert validate_config(make(**AWAKE, **_fractions(0.5, 0.8, "cpu"))).reward_model is not None
    assert validate_config(make(**_fractions(1.5, 0.5, "cpu"))) is not None


def test_a_reward_engine_that_sleeps_starts_and_wakes_beside_a_sleeping_rollout_engine():
    """verl's reward-loop examples (0.8 beside 0.5-0.7, free_cache_engine default true): never awake together,
    in the worker's process or in one beside it."""
    for extra in ({}, {"actor_rollout_ref.rollout.tensor_model_parallel_size": 2}):
        layout = validate_config(make(**LOOP, **_fractions(0.5, 0.8, **extra)))
        assert layout.reward_servers == bool(extra)


def test_engines_on_different_devices_are_not_summed():
    pool = {"rollout.n_gpus_per_node": 2, "async_training.staleness_threshold": 1.0}  # rollout pool of its own
    layout = validate_config(make(**AWAKE, **pool, **_fractions(0.5, 0.8)))
    assert layout.rollout is not None and "rollout" not in layout.roles_of("policy")
    hf = {"actor_rollout_ref.rollout.name": "hf", "reward_model.rollout.tensor_model_parallel_size": 1}
    assert validate_config(make(**AWAKE, **hf, **_fractions(0.5, 0.8))).reward_model is not None


def test_the_rollout_fraction_is_a_fraction_on_cuda():
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.gpu_memory_utilization=1.5 must be a fraction"):
        validate_config(make(**_fractions(1.5, 0.5)))
