"""`auto` settings (rlsp.config.auto): each rule's decision at its boundary, explicit values kept, bad
values refused, the reference following the actor, and what `python -m rlsp.check` prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlsp.check import run_checks
from rlsp.config.auto import (
    BUILTIN_SHAPES,
    HF_ROLLOUT_MAX_PARAMS,
    REFERENCE_BYTES,
    REPLICATE_SHARE,
    STATE_BYTES,
    resolve_auto,
)
from rlsp.config.auto_memory import activation_bytes
from rlsp.config.layout import RoleLayout, World
from rlsp.config.machine import GIB, Machine, machine_facts
from rlsp.config.model_shape import read_model_shape, shape_from_config
from rlsp.config.schema import TINY_MODEL, RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.models.tiny import TinyModelSpec, ensure_tiny_model
from rlsp.plan.memory import HeadShare, MemoryOptions, Workload, layer_saved_bytes

TINY = BUILTIN_SHAPES[TINY_MODEL]
CPU = Machine("cpu", 12 * GIB, "test host")


def config(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def resolved(cfg, machine=CPU):
    errors: list[str] = []
    choices = resolve_auto(cfg, errors, machine)
    assert errors == []
    return {c.key: c.value for c in choices}


def test_builtin_shape_is_the_built_model(tmp_path):
    """The table entry equals the config.json the factory writes for the default spec."""
    assert read_model_shape(ensure_tiny_model(str(tmp_path / "tiny"), TinyModelSpec())) == \
        BUILTIN_SHAPES[TINY_MODEL].__class__(**{**BUILTIN_SHAPES[TINY_MODEL].__dict__, "name": "tiny"})


def test_defaults_on_cpu_pick_hf_whole_model_and_token_budget():
    cfg = config()
    got = resolved(cfg)
    assert got == {"actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.actor.fsdp_config.fsdp_size": 1,
                   "actor_rollout_ref.ref.fsdp_config.fsdp_size": 1, "actor_rollout_ref.actor.use_dynamic_bsz": True,
                   "actor_rollout_ref.model.enable_gradient_checkpointing": False, "reward_model.num_workers": 0}
    # written into the config, followed by the keys that interpolate the actor's
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.critic.model.fsdp_config.fsdp_size in (1, -1)
    assert cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz is True and cfg.critic.use_dynamic_bsz is True


@pytest.mark.parametrize("shrink,expected", [(1.0, 1), (1.0 + 1e-9, -1)])
def test_fsdp_replicates_up_to_a_quarter_of_rank_memory(shrink, expected):
    """Boundary: the state (16 B a parameter + the reference's 4 B) x REPLICATE_SHARE against the rank's memory."""
    state = TINY.params * (STATE_BYTES + REFERENCE_BYTES)
    got = resolved(config(), Machine("cpu", state * REPLICATE_SHARE / shrink, "test"))
    assert got["actor_rollout_ref.actor.fsdp_config.fsdp_size"] == expected
    assert got["actor_rollout_ref.ref.fsdp_config.fsdp_size"] == expected


def test_fsdp_shards_when_memory_unknown_or_offloaded():
    assert resolved(config(), Machine("cuda", None, "no GPU here"))["actor_rollout_ref.actor.fsdp_config.fsdp_size"] == -1
    got = resolved(config(**{"actor_rollout_ref.actor.fsdp_config.param_offload": True}))
    assert got["actor_rollout_ref.actor.fsdp_config.fsdp_size"] == -1


def test_cuda_counts_only_what_vllm_leaves():
    """On cuda the colocated vLLM engine keeps gpu_memory_utilization of the device."""
    need = TINY.params * (STATE_BYTES + REFERENCE_BYTES) * REPLICATE_SHARE
    fits = resolved(config(), Machine("cuda", need / 0.5, "test"))
    short = resolved(config(), Machine("cuda", need / 0.5 * 0.99, "test"))
    assert fits["actor_rollout_ref.rollout.name"] == "vllm"
    assert fits["actor_rollout_ref.actor.fsdp_config.fsdp_size"] == 1
    assert short["actor_rollout_ref.actor.fsdp_config.fsdp_size"] == -1


def test_rollout_engine_rule(tmp_path):
    big = ensure_tiny_model(str(tmp_path / "big"), TinyModelSpec(hidden_size=512, intermediate_size=4096,
                                                                 num_hidden_layers=4, num_attention_heads=8))
    assert read_model_shape(big).params > HF_ROLLOUT_MAX_PARAMS
    assert resolved(config(**{"actor_rollout_ref.model.path": big}))["actor_rollout_ref.rollout.name"] == "vllm"
    assert resolved(config(**{"actor_rollout_ref.rollout.ignore_eos": True}))["actor_rollout_ref.rollout.name"] == "vllm"
    odd = ensure_tiny_model(str(tmp_path / "odd"), TinyModelSpec(hidden_size=64, intermediate_size=128))  # head_dim 16
    got = [c for c in resolve_auto(config(**{"actor_rollout_ref.model.path": odd}), [], CPU)
           if c.key == "actor_rollout_ref.rollout.name"]
    assert got[0].value == "hf" and "head_dim=16: vLLM's CPU attention has no kernel" in got[0].reason
    unknown = resolved(config(**{"actor_rollout_ref.model.path": "Qwen/Qwen2.5-0.5B"}))
    assert unknown["actor_rollout_ref.rollout.name"] == "vllm"
    assert unknown["actor_rollout_ref.actor.fsdp_config.fsdp_size"] == -1


def test_routing_replay_r3_picks_the_engine_that_records_routes(tmp_path):
    big = ensure_tiny_model(str(tmp_path / "big"), TinyModelSpec(hidden_size=512, intermediate_size=4096,
                                                                 num_hidden_layers=4, num_attention_heads=8))
    gpu = Machine("cuda", 80 * GIB, "test gpu")
    for key, value in (("actor_rollout_ref.actor.router_replay.mode", "R3"),
                       ("actor_rollout_ref.rollout.enable_rollout_routing_replay", True)):
        for machine in (CPU, gpu):  # vllm on either without R3 (a model over the hf limit; a GPU)
            got = [c for c in resolve_auto(config(**{"actor_rollout_ref.model.path": big, key: value}), [], machine)
                   if c.key == "actor_rollout_ref.rollout.name"]
            assert got[0].value == "hf" and "R3" in got[0].reason
    plain = [c for c in resolve_auto(config(**{"actor_rollout_ref.model.path": big}), [], gpu)
             if c.key == "actor_rollout_ref.rollout.name"]
    assert plain[0].value == "vllm"


def test_explicit_values_win_and_micro_batch_rows_keep_fixed_micro_batches():
    cfg = config(**{"actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.actor.fsdp_config.fsdp_size": 2,
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4})
    got = resolved(cfg)
    assert "actor_rollout_ref.rollout.name" not in got and "actor_rollout_ref.actor.fsdp_config.fsdp_size" not in got
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size == 2
    assert got["actor_rollout_ref.ref.fsdp_config.fsdp_size"] == 2  # follows the actor
    assert got["actor_rollout_ref.actor.use_dynamic_bsz"] is False


def test_bad_values_are_refused_naming_the_key():
    cfg = config(**{"actor_rollout_ref.actor.fsdp_config.fsdp_size": "half",
                    "actor_rollout_ref.actor.use_dynamic_bsz": "sometimes"})
    with pytest.raises(ValueError) as exc:
        validate_config(cfg)
    text = str(exc.value)
    assert "actor_rollout_ref.actor.fsdp_config.fsdp_size='half' must be auto" in text
    assert "actor_rollout_ref.actor.use_dynamic_bsz='sometimes' must be auto" in text
    # a gate: the checks after it never see an undecided key (exactly these two problems)
    assert text.count("\n  - ") == 2, text


def test_lora_reference_shares_the_actor_layout():
    cfg = config(**{"actor_rollout_ref.model.lora_rank": 4})
    layout = validate_config(cfg)
    assert layout.ref == layout.actor


def test_machine_facts_without_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    m = machine_facts("auto", 4)
    assert m.device == "cpu" and m.rank_memory is not None and m.rank_memory > 0
    assert machine_facts("cuda", 4).rank_memory is None or machine_facts("cuda", 4).device == "cuda"


def test_check_prints_the_choices():
    text = run_checks([]).render()
    assert "auto settings" in text
    assert "actor_rollout_ref.rollout.name=hf: 0.3M parameters on cpu" in text
    assert "actor_rollout_ref.actor.fsdp_config.fsdp_size=1: " in text


PUBLIC = json.loads((Path(__file__).resolve().parents[1] / "data" / "public_model_shapes.json").read_text())


def _public_model(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(PUBLIC[name]))
    return str(path)


@pytest.mark.parametrize("name", ["Qwen2.5-0.5B", "Llama-3.1-8B"])
@pytest.mark.parametrize("tokens,e", [(4096, 2), (16384, 4)])
def test_activation_bytes_is_the_planners_layer_term(name, tokens, e):
    """auto_memory's estimate equals the planner's saved bytes of every layer on one unsplit rank."""
    shape = shape_from_config(PUBLIC[name])
    w = Workload(layout=RoleLayout(World(1, 1)), budget=tokens, seq_len=tokens,
                 heads=HeadShare(shape.q_heads, shape.kv_heads))
    planner = shape.layers * layer_saved_bytes(shape, w, MemoryOptions(dtype_bytes=e))
    assert activation_bytes(shape, tokens, e) == pytest.approx(planner, rel=1e-12)
    assert activation_bytes(shape, tokens, e, splits=4) == pytest.approx(planner / 4, rel=1e-12)


def test_gpu_rules_for_public_shapes(tmp_path):
    """On an 80 GiB GPU with vLLM taking half: the 0.5B model is replicated, the 8B one sharded; both
    checkpoint at verl's usual 16k-token bf16 micro-batches (their activations exceed what is left)."""
    gpu = Machine("cuda", 80 * GIB, "test GPU")
    small = config(**{"actor_rollout_ref.model.path": _public_model(tmp_path, "Qwen2.5-0.5B"),
                      "actor_rollout_ref.model.dtype": "bfloat16", "trainer.n_gpus_per_node": 8})
    got = resolved(small, gpu)
    shape = shape_from_config(PUBLIC["Qwen2.5-0.5B"])
    state = shape.params * (STATE_BYTES + REFERENCE_BYTES)
    assert got["actor_rollout_ref.rollout.name"] == "vllm"
    assert got["actor_rollout_ref.actor.fsdp_config.fsdp_size"] == (1 if state * REPLICATE_SHARE <= 40 * GIB else -1) == 1
    saved = activation_bytes(shape, 16384, 2)
    assert got["actor_rollout_ref.model.enable_gradient_checkpointing"] is (saved > (40 * GIB - state) / 2) is True
    big = config(**{"actor_rollout_ref.model.path": _public_model(tmp_path, "Llama-3.1-8B"),
                    "actor_rollout_ref.model.dtype": "bfloat16", "trainer.n_gpus_per_node": 8,
                    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 1024})
    got = resolved(big, gpu)
    assert got["actor_rollout_ref.actor.fsdp_config.fsdp_size"] == -1
    shape8 = shape_from_config(PUBLIC["Llama-3.1-8B"])
    state8 = shape8.params * (STATE_BYTES + REFERENCE_BYTES) / 8  # sharded over the 8 ranks
    expected = activation_bytes(shape8, 1024, 2) > (40 * GIB - state8) / 2
    assert got["actor_rollout_ref.model.enable_gradient_checkpointing"] is expected


def test_checkpointing_follows_activation_offload_and_explicit_values():
    got = resolved(config(**{"actor_rollout_ref.model.enable_activation_offload": True}))
    assert got["actor_rollout_ref.model.enable_gradient_checkpointing"] is True
    cfg = config(**{"actor_rollout_ref.model.enable_gradient_checkpointing": True})
    assert "actor_rollout_ref.model.enable_gradient_checkpointing" not in resolved(cfg)
    assert resolved(config())["actor_rollout_ref.model.enable_gradient_checkpointing"] is False  # tiny on cpu


def test_nothing_auto_reads_nothing(monkeypatch):
    """Once every auto key is decided, neither the model nor the machine is read again (a run validates
    its config more than once)."""
    import rlsp.config.auto as auto

    cfg = config()
    assert resolved(cfg)  # decides every key

    def unexpected(*args):
        raise AssertionError("read although nothing is auto")

    monkeypatch.setattr(auto, "machine_facts", unexpected)
    monkeypatch.setattr(auto, "model_shape", unexpected)
    assert resolve_auto(cfg, [], None) == []


def test_rule_scoring_in_the_policy_workers_unless_a_rollout_pool_generates_meanwhile():
    assert resolved(config())["reward_model.num_workers"] == 0
    pool = config(**{"rollout.n_gpus_per_node": 2, "async_training.staleness_threshold": 0.5})
    assert resolved(pool)["reward_model.num_workers"] == 1
    explicit = config(**{"reward_model.num_workers": 3})
    assert "reward_model.num_workers" not in resolved(explicit) and explicit.reward_model.num_workers == 3


def test_a_follower_key_set_to_a_bad_value_is_named():
    cfg = config(**{"critic.use_dynamic_bsz": "often"})
    with pytest.raises(ValueError, match=r"critic.use_dynamic_bsz='often' must be true or false"):
        validate_config(cfg)
