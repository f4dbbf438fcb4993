"""`auto` expert parallelism (rlsp.config.auto_memory.ep_value): 1 for a dense model or when the rank's training state
plus FSDP's gathered experts fit in half its memory, else the smallest degree dividing the ranks and the experts that
fits; the reference follows the actor; `rlsp.check` prints the choice with its reason, the model's total and active
parameters, and refuses a router auxiliary loss on a family without transformers' load-balancing loss by name."""

from __future__ import annotations

import pandas as pd
import pytest
from omegaconf import OmegaConf
from tiny_moe import moe_config, write_tiny_moe

from rlsp.check import main as check_main
from rlsp.config.auto import resolve_auto
from rlsp.config.auto_memory import EP_REFERENCE_BYTES, EP_STATE_BYTES, ep_rank_bytes, ep_value, routed_params
from rlsp.config.machine import GIB, Machine
from rlsp.config.model_shape import read_model_shape
from rlsp.config.schema import TINY_MODEL, RLSPConfig

EP_KEY = "actor_rollout_ref.actor.fsdp_config.expert_parallel_size"
REF_KEY = "actor_rollout_ref.ref.fsdp_config.expert_parallel_size"
STATE = EP_STATE_BYTES + EP_REFERENCE_BYTES  # the actor with a reference (use_kl_loss, the default)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3_moe_cfg")
    moe_config("qwen3_moe", num_experts=8).save_pretrained(path)  # config.json is all the rules read
    return str(path)


def _resolve(path: str, memory: float, ranks: int = 4, **extra) -> dict:
    cfg = OmegaConf.structured(RLSPConfig)
    for key, value in {"actor_rollout_ref.model.path": path, "trainer.n_gpus_per_node": ranks, EP_KEY: "auto",
                       REF_KEY: "auto", **extra}.items():
        OmegaConf.update(cfg, key, value)
    errors: list[str] = []
    choices = resolve_auto(cfg, errors, Machine("cpu", memory, "test"))
    assert errors == []
    return {c.key: (c.value, c.reason) for c in choices}


def test_ep_rule_counts_the_planners_routed_experts(moe_dir):
    shape = read_model_shape(moe_dir)
    routed, layer, experts = routed_params(shape)
    assert (experts, layer) == (8, 8 * 3 * 64 * 32) and routed == 2 * layer
    # one rank's state of 4, plus 1/ep of a layer's experts gathered (two in flight + gradients, fp32)
    assert ep_rank_bytes(shape, 2, 4, 4, 4) == shape.params * 16 / 4 + layer / 2 * 12
    assert ep_rank_bytes(shape, 1, 4, 1, 4) == shape.params * 16 + layer * 12  # fsdp_size=1: whole state


def test_auto_ep_is_1_when_it_fits_and_2_when_only_half_the_experts_do(moe_dir):
    shape = read_model_shape(moe_dir)
    need1, need2 = (ep_rank_bytes(shape, ep, 4, 4, 4, STATE) for ep in (1, 2))
    small = _resolve(moe_dir, need1 + need2)  # half of it: between the two
    assert small["actor_rollout_ref.actor.fsdp_config.fsdp_size"][0] == -1  # sharded over the 4 ranks
    value, reason = small[EP_KEY]
    assert value == 2 and "the smallest degree dividing both the 4 ranks and the 8 experts" in reason, reason
    assert small[REF_KEY] == (2, "the reference follows the actor")
    assert _resolve(moe_dir, 2 * need1 + 1)[EP_KEY][0] == 1
    assert _resolve(moe_dir, 2 * need1 - 1)[EP_KEY][0] == 2
    big = _resolve(moe_dir, 64 * GIB)
    assert big[EP_KEY][0] == 1 and "every rank runs every expert" in big[EP_KEY][1]


def test_auto_ep_keeps_1_for_dense_models_tp_and_too_few_ranks(moe_dir):
    assert _resolve(TINY_MODEL, 1.0)[EP_KEY] == (1, "tiny-qwen2 is dense (no routed experts): 1")
    tp = _resolve(moe_dir, 1.0, **{"actor_rollout_ref.actor.tensor_model_parallel_size": 2})[EP_KEY]
    assert tp[0] == 1 and "tensor_model_parallel_size=2" in tp[1]
    value, reason = ep_value(read_model_shape(moe_dir), "", 1.0, 3, 3, 4)  # 3 ranks: no degree divides 8 experts
    assert value == 1 and "no degree > 1 divides both the 3 ranks and the 8 experts" in reason
    assert ep_value(read_model_shape(moe_dir), "no memory", None, 4, 4, 4) == (1, "no memory: 1")


@pytest.fixture(scope="module")
def check_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_check")
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+1"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}} for i in range(4)]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    return {"qwen3_moe": write_tiny_moe("qwen3_moe", str(root / "qwen3_moe")),
            "glm4_moe": write_tiny_moe("glm4_moe", str(root / "glm4_moe")), "train": str(root / "train.parquet")}


def _check(tmp_path, dirs, family: str, *overrides: str, capsys) -> tuple[int, str]:
    rc = check_main(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={dirs['train']}",
                     "data.val_files=null", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=hf",
                     f"actor_rollout_ref.model.path={dirs[family]}", *overrides])
    return rc, capsys.readouterr().out


AUX = ("+actor_rollout_ref.model.override_config.output_router_logits=True",
       "+actor_rollout_ref.model.override_config.router_aux_loss_coef=0.001")


def test_check_prints_auto_ep_and_parameters_and_accepts_the_aux_loss(tmp_path, check_dirs, capsys):
    rc, out = _check(tmp_path, check_dirs, "qwen3_moe", f"{EP_KEY}=auto", *AUX, capsys=capsys)
    assert rc == 0, out
    assert f"{EP_KEY}=1: training state + gathered experts at EP 1" in out, out
    shape = read_model_shape(check_dirs["qwen3_moe"])
    assert f"parameters: {shape.params:,} total, {shape.active_decoder_params + shape.root_params:,} active" in out


def test_check_refuses_the_aux_loss_by_family_and_other_overrides_by_name(tmp_path, check_dirs, capsys):
    rc, out = _check(tmp_path, check_dirs, "glm4_moe", *AUX, capsys=capsys)
    assert rc == 2 and "output_router_logits=True with router_aux_loss_coef=0.001 (model glm4_moe)" in out, out
    rc, out = _check(tmp_path, check_dirs, "qwen3_moe", "+actor_rollout_ref.model.override_config.rope_theta=1",
                     capsys=capsys)
    assert rc == 2 and "override_config.rope_theta" in out, out
