"""`start_pool` starts every worker pool; on CPU each pool binds the cores after the pools started before
it (policy, then a critic pool of its own, then a rollout pool), so pools sharing a node never share a core."""

from __future__ import annotations

from omegaconf import OmegaConf

from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.controller.worker_pools import _workers_before

PPO_ASYNC = {"algorithm.adv_estimator": "gae", "critic.colocate": False, "critic.nnodes": 1, "critic.n_gpus_per_node": 1,
             "trainer.n_gpus_per_node": 2, "rollout.n_gpus_per_node": 2, "data.train_batch_size": 4,
             "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "critic.ppo_mini_batch_size": 4,
             "async_training.require_batches": 1}


def _layout(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in overrides.items():
        OmegaConf.update(cfg, key, val)
    return validate_config(cfg)


def test_pools_take_consecutive_workers():
    layout = _layout(**PPO_ASYNC)
    assert (layout.world_size, layout.role("critic").world_size, layout.rollout.world_size) == (2, 1, 2)
    # policy ranks 0-1, the critic's rank 2, the rollout pool's ranks 3-4: 5 workers in all
    assert [_workers_before(layout, g) for g in ("policy", "critic", "rollout")] == [0, 2, 3]
    assert layout.total_workers == 5


def test_colocated_critic_takes_no_workers_of_its_own():
    layout = _layout(**{**PPO_ASYNC, "critic.colocate": True})
    assert [_workers_before(layout, g) for g in ("policy", "rollout")] == [0, 2]
    assert layout.total_workers == 4
