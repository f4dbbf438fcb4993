"""Config checks of rollout tensor parallelism, FSDP offload and the reward model, and the layouts they give.

Each legal setting shows up in the layout (rollout tp: engines = dp groups of the rollout; reward model:
a role of the policy pool with its own Ulysses degree); each illegal one is refused before any worker
starts, naming the key and the legal values or the reason.
"""

from __future__ import annotations

import logging
import os

import pytest
from omegaconf import OmegaConf
from test_config import make
from transformers import Qwen2Config

from rlsp.checks.preflight import preflight
from rlsp.config.layout import RoleLayout, World
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_reward_model
from rlsp.rollout.support import check_rollout_support
from rlsp.rollout.vllm_engine import clear_stale_cpu_tp_segments

TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"
ACTOR_FSDP = "actor_rollout_ref.actor.fsdp_config."


def test_rollout_tp_layout_and_refusals():
    layout = validate_config(make(**{TP: 2, "trainer.n_gpus_per_node": 4, "data.train_batch_size": 4,
                                     "actor_rollout_ref.actor.ppo_mini_batch_size": 4}))
    assert layout.rollout_tp == 2 and layout.role("rollout") == RoleLayout(World(1, 4), tp=2)
    assert layout.role("rollout").dp_size == 2 and layout.role("rollout").ranks_per_dp == 2
    assert layout.node_local_sizes("policy") == (1, 2) and "rollout tp=2" in layout.describe()
    assert validate_config(make()).node_local_sizes("policy") == (1,)
    for overrides, needle in (
        ({TP: 2, "actor_rollout_ref.rollout.name": "hf"}, f"{TP}=2 needs actor_rollout_ref.rollout.name=vllm"),
        ({TP: 4}, f"{TP}=4 must divide the 2 rollout workers per node (trainer.n_gpus_per_node)"),
        ({TP: 0}, f"{TP}=0 must be an integer >= 1"),
    ):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            validate_config(make(**overrides))


def test_stale_cpu_tp_segments_of_this_rank_only_are_removed(tmp_path):
    """A killed run's vLLM CPU all-reduce segments would make the next engine of the same ranks fail (EEXIST)."""
    names = ["-tp:0-[2-3]-cpushm_0", "-tp:0-[2-3]-cpushm_1", "-tp:0-[0-1]-cpushm_0", "psm_1", "7-tp:1-[2-3]-cpushm_0"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    removed = clear_stale_cpu_tp_segments(2, 2, str(tmp_path))  # rank 2 = index 0 of the tp group [2, 3]
    assert sorted(os.path.basename(p) for p in removed) == ["-tp:0-[2-3]-cpushm_0", "7-tp:1-[2-3]-cpushm_0"]
    assert sorted(os.listdir(tmp_path)) == ["-tp:0-[0-1]-cpushm_0", "-tp:0-[2-3]-cpushm_1", "psm_1"]
    assert clear_stale_cpu_tp_segments(1, 0, str(tmp_path)) == []  # one rank per engine: no segments


def test_rollout_tp_against_the_models_heads():
    config = Qwen2Config(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=2)
    assert check_rollout_support(config, "vllm", "cuda", 2) is None
    assert check_rollout_support(config, "vllm", "cuda", 6) is None  # 2 kv heads replicated 3x
    assert "must divide the model's 6 attention heads; legal values: [1, 2, 3, 6]" in \
        check_rollout_support(config, "vllm", "cuda", 4)
    assert "legal values: [1, 2, 6]" in check_rollout_support(config, "vllm", "cuda", 3)  # 3 vs 2 kv heads


@pytest.mark.parametrize("overrides,needle", [
    ({"actor_rollout_ref.ref.fsdp_config.optimizer_offload": True},
     "actor_rollout_ref.ref.fsdp_config.optimizer_offload=true is not supported: this role is frozen"),
    ({ACTOR_FSDP + "optimizer_offload": True},
     f"{ACTOR_FSDP}optimizer_offload=true without {ACTOR_FSDP}param_offload=true is not supported"),
    ({"algorithm.adv_estimator": "gae", "critic.model.fsdp_config.optimizer_offload": True},
     "critic.model.fsdp_config.optimizer_offload=true without critic.model.fsdp_config.param_offload=true"),
])
def test_offload_combinations_fsdp2_cannot_honour_are_refused(overrides, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        validate_config(make(**overrides))


@pytest.mark.parametrize("overrides", [
    {ACTOR_FSDP + "param_offload": True}, {ACTOR_FSDP + "param_offload": True, ACTOR_FSDP + "optimizer_offload": True},
    {ACTOR_FSDP + "offload_policy": True, ACTOR_FSDP + "optimizer_offload": True},
    {"actor_rollout_ref.ref.fsdp_config.param_offload": True},
    # With LoRA the reference shares the actor's engine: accepted, no effect (a start-up note says so), as in verl.
    {"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.ref.fsdp_config.param_offload": True,
     "actor_rollout_ref.ref.fsdp_config.offload_policy": True}])
def test_offload_settings_rlsp_applies(overrides):
    validate_config(make(**overrides))


def test_no_effect_settings_are_logged_once_naming_the_key(caplog):
    """use_remove_padding=false and, with LoRA, the reference's offload keys are accepted: start-up says
    once that they have no effect, naming the key (`python -m rlsp.check` shows the same note)."""
    from rlsp.workers.roles.common import note_padding, note_shared_reference_offload

    ref = OmegaConf.create({"param_offload": True, "offload_policy": False})
    with caplog.at_level(logging.INFO, logger="rlsp.workers"):
        for _ in range(2):
            note_padding("critic.model", False, "values")
            note_shared_reference_offload(ref)
        note_padding("actor_rollout_ref.model", True, "logprobs and entropy")  # true: nothing to say
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "critic.model.use_remove_padding=false has no effect: rlsp always runs packed sequences without padding, "
        "which computes the same values as verl's padded forward",
        "actor_rollout_ref.ref.fsdp_config.param_offload / offload_policy=true has no effect with LoRA: the reference "
        "is the actor's engine with the adapters off and shares its base weights, which "
        "actor_rollout_ref.actor.fsdp_config.* offloads (or not)"]


def test_reward_model_layout_and_refusals():
    on = {"reward_model.enable": True, "reward_model.model.path": "/rm"}
    layout = validate_config(make(**on, **{"reward_model.ulysses_sequence_parallel_size": 2}))
    assert layout.reward_model == RoleLayout(World(1, 2), ulysses=2)
    assert layout.roles_of("policy")[-1] == "reward_model" and layout.node_local_sizes("policy") == (1, 2)
    assert validate_config(make(**{"reward_model.num_workers": 8})).reward_model is None  # off: not read
    with pytest.raises(ValueError) as err:
        validate_config(make(**on, **{"reward_model.reward_manager": "prime", "reward_model.ulysses_sequence_parallel_size": 3,
                                      "reward_model.model.use_remove_padding": False}))
    for needle in ("reward.reward_manager.name='prime' is not supported (reward managers other than naive, dapo and gdpo",
                   "reward_model.ulysses_sequence_parallel_size=3 must divide the 2 workers per node",
                   "reward_model.model.use_remove_padding=false is not supported"):
        assert needle in str(err.value)
    with pytest.raises(ValueError, match=r"reward_model.enable=true needs reward_model.model.path"):
        validate_config(make(**{"reward_model.enable": True}))


def test_reward_model_preflight(tmp_path):
    policy = build_tiny_model(TinyModelSpec(), str(tmp_path / "policy"))
    rm = build_tiny_reward_model(TinyModelSpec(), str(tmp_path / "rm"), chat_template="{{ messages }}")
    cfg = OmegaConf.structured(RLSPConfig)
    for key, value in {"trainer.cache_dir": str(tmp_path / "cache"), "trainer.device": "cpu",
                       "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.model.path": policy,
                       "reward_model.enable": True, "reward_model.model.path": rm}.items():
        OmegaConf.update(cfg, key, value)
    assert preflight(cfg).reward_model.model.input_tokenizer == policy  # re-rendered in the RM's template
    OmegaConf.update(cfg, "reward_model.model.input_tokenizer", None)
    with pytest.raises(ValueError, match=r"input_tokenizer=null feeds the policy's token ids .* differs"):
        preflight(cfg)
    OmegaConf.update(cfg, "reward_model.model.path", policy)
    OmegaConf.update(cfg, "reward_model.model.input_tokenizer", policy)
    with pytest.raises(ValueError, match=r"reward_model.model.path: architectures=\['Qwen2ForCausalLM'\]: a reward "
                                         r"model must be a \*ForSequenceClassification checkpoint"):
        preflight(cfg)
