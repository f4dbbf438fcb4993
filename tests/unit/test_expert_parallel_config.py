"""Expert parallelism's settings: `*.fsdp_config.expert_parallel_size` (and verl FSDP-Turbo's spelling) become the
layout's `ep`; a degree that does not divide the role's ranks or the model's experts, a dense model, a family whose
experts bypass transformers' experts registry, tensor parallelism or adaptive Ulysses beside it, and the reward
model are refused before any worker starts, naming the key, the value and what is legal; `rlsp.check` prints it."""

from __future__ import annotations

import pandas as pd
import pytest
from omegaconf import OmegaConf
from tiny_moe import moe_config, write_tiny_moe
from transformers import JetMoeConfig, LlamaConfig

from rlsp.check import main as check_main
from rlsp.config.layout import RoleLayout, World
from rlsp.config.layout_build import build_layout
from rlsp.config.schema import RLSPConfig
from rlsp.config.verl_spellings import rlsp_key
from rlsp.parallel.ep_checks import check_ep_support

ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")
BASE = {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.use_kl_loss": True, "trainer.n_gpus_per_node": 4,
        "data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        **{f"{role}.fsdp_config.fsdp_size": -1 for role in ROLES}}


def _layout(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {**BASE, **overrides}.items():
        OmegaConf.update(cfg, key, val, force_add=True)
    errors: list[str] = []
    return build_layout(cfg, errors), errors


def test_ep_becomes_the_roles_degree():
    layout, errors = _layout(**{"actor_rollout_ref.actor.fsdp_config.expert_parallel_size": 2,
                                "actor_rollout_ref.ref.fsdp_config.expert_parallel_size": "auto"})
    assert not errors, errors
    assert layout.actor == RoleLayout(World(1, 4), ep=2) and layout.actor.ep_replicas == 2
    assert layout.ref.ep == 1  # auto = 1
    assert "ep=2" in layout.describe()


@pytest.mark.parametrize("overrides,message", [
    ({"actor_rollout_ref.actor.fsdp_config.expert_parallel_size": 3},
     "actor_rollout_ref.actor.fsdp_config.expert_parallel_size=3 does not divide the role's 4 ranks (its "
     "expert-parallel groups are runs of 3 consecutive ranks); legal values: [1, 2, 4]"),
    ({"actor_rollout_ref.ref.fsdp_config.expert_parallel_size": 0},
     "actor_rollout_ref.ref.fsdp_config.expert_parallel_size=0 must be auto or an integer >= 1"),
    ({"actor_rollout_ref.actor.fsdp_config.expert_parallel_size": 2,
      "actor_rollout_ref.actor.tensor_model_parallel_size": 2},
     "actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2 needs actor_rollout_ref.actor."
     "tensor_model_parallel_size=1 (got 2)"),
    ({"algorithm.adv_estimator": "gae", "critic.model.fsdp_config.expert_parallel_size": 8},
     "critic.model.fsdp_config.expert_parallel_size=8 does not divide the role's 4 ranks"),
    ({"reward_model.enable": True, "reward_model.model.path": "rm", "reward_model.use_reward_loop": False,
      "reward_model.model.fsdp_config.expert_parallel_size": 2},
     "reward_model.model.fsdp_config.expert_parallel_size=2: the reward model runs every expert on every rank"),
])
def test_illegal_ep_is_refused_by_key_value_and_legal_values(overrides, message):
    _, errors = _layout(**overrides)
    assert any(message in e for e in errors), errors


def test_verl_turbo_spelling_is_the_same_setting():
    block = "turbo_config.distributed.expert_parallel_size"
    assert rlsp_key(f"actor_rollout_ref.actor.fsdp_config.{block}") == "actor_rollout_ref.actor.fsdp_config.expert_parallel_size"
    assert rlsp_key(f"actor_rollout_ref.ref.fsdp_config.{block}") == "actor_rollout_ref.ref.fsdp_config.expert_parallel_size"
    assert rlsp_key(f"critic.fsdp.{block}") == "critic.model.fsdp_config.expert_parallel_size"


def test_model_checks_name_the_experts_and_the_legal_degrees():
    check_ep_support(LlamaConfig(), 1)
    check_ep_support(moe_config("qwen3_moe"), 2)
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide the 4 experts of each qwen3_moe "
                                         r"MoE layer; legal values: \[1, 2, 4\]"):
        check_ep_support(moe_config("qwen3_moe"), 3)
    with pytest.raises(ValueError, match="llama has no routed experts .*legal value: 1"):
        check_ep_support(LlamaConfig(), 2)
    with pytest.raises(ValueError, match="jetmoe's experts do not compute through transformers' experts registry"):
        check_ep_support(JetMoeConfig(num_local_experts=4), 2)


@pytest.fixture(scope="module")
def six_expert_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ep_check")
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+1"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}} for i in range(8)]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    return {"model": write_tiny_moe("qwen3_moe", str(root / "qwen3_moe"), num_experts=6),
            "train": str(root / "train.parquet")}


def _check(tmp_path, dirs, *overrides: str, capsys) -> tuple[int, str]:
    rc = check_main(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={dirs['train']}",
                     "data.val_files=null", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.name=hf",
                     f"actor_rollout_ref.model.path={dirs['model']}", *overrides])
    return rc, capsys.readouterr().out


def test_check_prints_ep_and_refuses_one_that_does_not_divide_the_experts(tmp_path, six_expert_dirs, capsys):
    rc, out = _check(tmp_path, six_expert_dirs,
                     "actor_rollout_ref.actor.fsdp_config.turbo_config.distributed.expert_parallel_size=2",
                     capsys=capsys)
    assert rc == 0, out
    assert "ep=2" in out and "MoE experts split over ep=2 consecutive ranks" in out, out
    rc, out = _check(tmp_path, six_expert_dirs, "actor_rollout_ref.actor.fsdp_config.expert_parallel_size=4",
                     capsys=capsys)
    assert rc == 2 and ("actor_rollout_ref.actor.fsdp_config.expert_parallel_size: expert_parallel_size=4 does not "
                        "divide the 6 experts of each qwen3_moe MoE layer; legal values: [1, 2, 3, 6]") in out, out


def test_planner_gathers_one_ep_share_of_the_experts_and_shards_them_over_every_rank():
    """rlsp.plan: a layer's all-gather brings 1/ep of its routed experts; the expert state sits on every FSDP rank
    once (with HSDP too, where the other weights are sharded over fsdp_size ranks only)."""
    from rlsp.config.model_shape import shape_from_config
    from rlsp.plan.memory import buffer_terms, state_bytes

    shape = shape_from_config(moe_config("qwen3_moe").to_dict())
    routed = 4 * 3 * 64 * 32  # 4 experts of gate/up/down, hidden 64, width 32, per layer
    world = World(1, 4)
    for e in (4, 2):
        plain, ep2 = (buffer_terms(shape, RoleLayout(world, ep=ep), "actor", e) for ep in (1, 2))
        cast = 4 if e < 4 else 0
        assert plain["layers_unsharded"] - ep2["layers_unsharded"] == pytest.approx(routed / 2 * (3 * e + cast))
    assert state_bytes(shape, RoleLayout(world, ep=2), "actor", 2) == state_bytes(shape, RoleLayout(world), "actor", 2)
    hsdp, hsdp_ep = (state_bytes(shape, RoleLayout(world, fsdp_size=2, ep=ep), "actor", 2)[0] for ep in (1, 2))
    assert hsdp - hsdp_ep == pytest.approx(2 * routed * (1 / 2 - 1 / 4) * 12)  # 2 MoE layers
