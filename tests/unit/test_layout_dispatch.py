"""The parallel layout validate_config returns, critic config checks, and the declared dispatch contracts."""

from __future__ import annotations

import pytest
from test_config import make

from rlsp.config.layout import ParallelLayout, RoleLayout, World
from rlsp.config.validate import validate_config
from rlsp.workers.dispatch import Dispatch, dispatch_mode
from rlsp.workers.roles import ROLE_CLASSES
from rlsp.workers.worker import Worker


def test_layout_without_and_with_critic():
    layout = validate_config(make())
    policy = World(1, 2)
    # fsdp_size auto: the tiny model's training state fits every worker, so each holds all of it
    whole = RoleLayout(policy, fsdp_size=1)
    assert layout == ParallelLayout(policy, whole, whole) and not layout.has_critic
    assert layout.roles_of("policy") == ("actor", "ref", "rollout")
    ppo = validate_config(make(**{"algorithm.adv_estimator": "gae", "critic.ulysses_sequence_parallel_size": 2}))
    assert ppo.critic == RoleLayout(policy, ulysses=2, fsdp_size=1) and ppo.critic_colocated and ppo.total_workers == 2
    assert ppo.roles_of("policy") == ("actor", "ref", "rollout", "critic")
    assert ppo.role("critic").dp_size == 1 and ppo.role("actor").dp_size == 2
    own = validate_config(make(**{"algorithm.adv_estimator": "gae", "critic.colocate": False,
                                  "critic.n_gpus_per_node": 3, "data.train_batch_size": 6,
                                  "actor_rollout_ref.actor.ppo_mini_batch_size": 6, "critic.ppo_mini_batch_size": 3}))
    assert own.total_workers == 5 and own.roles_of("critic") == ("critic",)
    assert own.roles_of("policy") == ("actor", "ref", "rollout")


def test_ranks_are_numbered_node_by_node():
    world = World(nnodes=2, procs_per_node=4)
    mesh = RoleLayout(world, ulysses=2)
    assert [world.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [mesh.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # an sp group = consecutive ranks, all on one node
    assert all(len({world.node_of(r) for r in range(g * 2, g * 2 + 2)}) == 1 for g in range(4))


def test_every_degree_has_its_place_in_the_rank_order():
    """rank = ((dp * ring + ring_rank) * ulysses + ulysses_rank) * tp + tp_rank; ulysses x tp stay on a node."""
    world = World(nnodes=2, procs_per_node=4)
    lay = RoleLayout(world, ulysses=2, ring=2, tp=1)
    assert (lay.sp_size, lay.dp_size, lay.ranks_per_dp, lay.token_shards, lay.stream_multiple) == (4, 2, 4, 4, 8)
    assert [(c.dp, c.ring, c.ulysses) for c in map(lay.coords, range(8))] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    across = RoleLayout(world, ulysses=4, ring=2)  # ring pairs (r, r + 4) cross the nodes
    assert [across.coords(r).ring for r in range(8)] == [0] * 4 + [1] * 4
    assert {world.node_of(r) for r in range(8) if across.coords(r).ulysses == 1} == {0, 1}
    tp = RoleLayout(world, ulysses=1, ring=1, tp=2, sequence_parallel=True)
    assert (tp.dp_size, tp.token_shards, tp.fsdp_ranks, tp.stream_multiple) == (4, 2, 4, 2)
    assert [tp.coords(r).tp for r in range(4)] == [0, 1, 0, 1]
    assert RoleLayout(world, tp=2, sequence_parallel=False).token_shards == 1


@pytest.mark.parametrize("overrides,needle", [
    ({"actor_rollout_ref.actor.ring_sequence_parallel_size": 3},
     "ulysses 1 x ring 3 x tp 1 = 3 ranks per data-parallel group does not divide the 2 workers"),
    ({"trainer.n_gpus_per_node": 4, "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
      "actor_rollout_ref.actor.tensor_model_parallel_size": 4},
     "ulysses_sequence_parallel_size=2 x tensor_model_parallel_size=4 must divide the 4 workers per node"),
    ({"actor_rollout_ref.actor.ring_sequence_parallel_size": 0},
     "actor_rollout_ref.actor.ring_sequence_parallel_size=0 must be an integer >= 1"),
    ({"actor_rollout_ref.ref.ring_sequence_parallel_size": 4}, "actor_rollout_ref.ref.ring_sequence_parallel_size=4"),
    ({"actor_rollout_ref.actor.sequence_parallel_adaptive": True, "actor_rollout_ref.actor.use_dynamic_bsz": True},
     "it needs ulysses_sequence_parallel_size > 1 (got 1)"),
    ({"actor_rollout_ref.actor.sequence_parallel_adaptive": True, "actor_rollout_ref.actor.use_dynamic_bsz": False,
      "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2},
     "actor has sequence_parallel_adaptive=true, which picks each micro-batch's Ulysses degree from its token "
     "budget: set actor_rollout_ref.actor.use_dynamic_bsz=true"),
])
def test_bad_degrees_are_named(overrides, needle):
    with pytest.raises(ValueError) as err:
        validate_config(make(**overrides))
    assert needle in str(err.value)


def test_ring_may_span_nodes_and_the_reference_inherits_the_actor():
    layout = validate_config(make(**{"trainer.nnodes": 2, "trainer.n_gpus_per_node": 2, "data.train_batch_size": 16,
                                     "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
                                     "actor_rollout_ref.actor.ring_sequence_parallel_size": 2}))
    assert (layout.actor.ulysses, layout.actor.ring, layout.actor.dp_size) == (2, 2, 1)
    assert layout.ref == layout.actor and layout.node_local_sizes("policy") == (2,)
    own = validate_config(make(**{"actor_rollout_ref.actor.ring_sequence_parallel_size": 2,
                                  "actor_rollout_ref.ref.ring_sequence_parallel_size": 1}))
    assert own.actor.ring == 2 and own.ref.ring == 1 and "| ref dp=2" in own.describe()
    adaptive = validate_config(make(**{"actor_rollout_ref.actor.sequence_parallel_adaptive": True,
                                       "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
                                       "actor_rollout_ref.actor.use_dynamic_bsz": True,
                                       "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": True}))
    assert adaptive.actor.ulysses_degrees == (1, 2) and adaptive.ref.adaptive
    assert "ulysses=2 (adaptive)" in adaptive.describe()


@pytest.mark.parametrize("overrides,needle", [
    ({"trainer.nnodes": 2, "trainer.n_gpus_per_node": 2, "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 4,
      "data.train_batch_size": 16}, "ulysses_sequence_parallel_size=4 x tensor_model_parallel_size=1 must divide the 2 workers per node (their all-to-alls and all-gathers stay inside a node); legal values: [1, 2] (for ulysses x tp)"),
    ({"algorithm.adv_estimator": "gae", "critic.ulysses_sequence_parallel_size": 3},
     "critic.ulysses_sequence_parallel_size=3 x tensor_model_parallel_size=1 must divide the 2 workers per node"),
    ({"algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 5}, "critic.ppo_mini_batch_size=5 must divide"),
    ({"algorithm.adv_estimator": "gae", "critic.cliprange_value": 0.0}, "critic.cliprange_value=0.0 must be > 0"),
    ({"algorithm.kl_penalty": "k9"}, "algorithm.kl_penalty='k9' is not supported; legal values: ['k1', 'kl', 'abs', 'k2', 'mse', 'k3', 'low_var_kl']"),
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
    for role, method in (("rollout", "generate"), ("actor", "compute_log_prob"), ("actor", "update_actor"),
                         ("ref", "compute_ref_log_prob"), ("critic", "compute_values"), ("critic", "update_critic"),
                         ("critic", "sp_self_check"), ("reward_model", "compute_rm_score")):
        assert dispatch_mode(ROLE_CLASSES[role], method) is Dispatch.BY_DP
    assert dispatch_mode(Worker, "sync_weights") is Dispatch.ALL
    with pytest.raises(ValueError, match=r"CriticRole.engine has no dispatch declaration; dispatchable methods: "
                                         r"\['compute_values', 'load_checkpoint', 'param_checksum', 'save_checkpoint', 'sp_self_check', 'update_critic'\]"):
        dispatch_mode(ROLE_CLASSES["critic"], "engine")
