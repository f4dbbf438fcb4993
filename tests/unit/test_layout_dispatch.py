"""The parallel layout validate_config returns, critic config checks, and the declared dispatch contracts."""

from __future__ import annotations

import pytest
from test_config import make

from rlsp.config.layout import MeshLayout, ParallelLayout
from rlsp.config.validate import validate_config
from rlsp.workers.dispatch import Dispatch, dispatch_mode
from rlsp.workers.roles import ROLE_CLASSES
from rlsp.workers.worker import Worker


def test_layout_without_and_with_critic():
    layout = validate_config(make())
    assert layout == ParallelLayout(MeshLayout(1, 2, 1)) and not layout.has_critic
    assert layout.roles_of("policy") == ("actor", "ref", "rollout")
    ppo = validate_config(make(**{"algorithm.adv_estimator": "gae", "critic.ulysses_sequence_parallel_size": 2}))
    assert ppo.critic == MeshLayout(1, 2, 2) and ppo.critic_colocated and ppo.total_workers == 2
    assert ppo.roles_of("policy") == ("actor", "ref", "rollout", "critic")
    assert ppo.role_mesh("critic").dp_size == 1 and ppo.role_mesh("actor").dp_size == 2
    own = validate_config(make(**{"algorithm.adv_estimator": "gae", "critic.colocate": False,
                                  "critic.n_gpus_per_node": 3, "data.train_batch_size": 6,
                                  "actor_rollout_ref.actor.ppo_mini_batch_size": 6, "critic.ppo_mini_batch_size": 3}))
    assert own.total_workers == 5 and own.roles_of("critic") == ("critic",)
    assert own.roles_of("policy") == ("actor", "ref", "rollout")


def test_ranks_are_numbered_node_by_node():
    mesh = MeshLayout(nnodes=2, procs_per_node=4, sp_size=2)
    assert [mesh.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [mesh.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # an sp group = consecutive ranks, all on one node
    assert all(len({mesh.node_of(r) for r in range(g * 2, g * 2 + 2)}) == 1 for g in range(4))


@pytest.mark.parametrize("overrides,needle", [
    ({"trainer.nnodes": 2, "trainer.n_gpus_per_node": 2, "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 4,
      "data.train_batch_size": 16}, "would make sequence-parallel groups span nodes (2 workers per node); legal values: [1, 2]"),
    ({"algorithm.adv_estimator": "gae", "critic.ulysses_sequence_parallel_size": 3},
     "critic.ulysses_sequence_parallel_size=3 does not divide the 2 training workers"),
    ({"algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 5}, "critic.ppo_mini_batch_size=5 must divide"),
    ({"algorithm.adv_estimator": "gae", "critic.cliprange_value": 0.0}, "critic.cliprange_value=0.0 must be > 0"),
    ({"algorithm.kl_penalty": "k9"}, "algorithm.kl_penalty='k9' is not supported; legal values: ['kl', 'abs', 'mse', 'low_var_kl']"),
    ({"algorithm.kl_ctrl.type": "pid"}, "algorithm.kl_ctrl.type='pid' is not supported"),
    ({"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.horizon": 0}, "algorithm.kl_ctrl.horizon=0 must be >= 1"),
    ({"trainer.critic_warmup": 2}, "trainer.critic_warmup=2 needs a critic"),
    ({"algorithm.lam": 1.5}, "algorithm.lam=1.5 must be in [0, 1]"),
])
def test_bad_ppo_settings_are_named(overrides, needle):
    with pytest.raises(ValueError) as err:
        validate_config(make(**overrides))
    assert needle in str(err.value)


def test_every_dispatched_method_declares_its_contract():
    assert dispatch_mode(ROLE_CLASSES["rollout"], "generate") is Dispatch.BY_RANK
    for role, method in (("actor", "compute_log_prob"), ("actor", "update_actor"), ("ref", "compute_ref_log_prob"),
                         ("critic", "compute_values"), ("critic", "update_critic"), ("critic", "sp_self_check")):
        assert dispatch_mode(ROLE_CLASSES[role], method) is Dispatch.BY_DP
    assert dispatch_mode(Worker, "sync_weights") is Dispatch.ALL
    with pytest.raises(ValueError, match=r"CriticRole.engine has no dispatch declaration; dispatchable methods: "
                                         r"\['compute_values', 'load_checkpoint', 'param_checksum', 'save_checkpoint', 'sp_self_check', 'update_critic'\]"):
        dispatch_mode(ROLE_CLASSES["critic"], "engine")
