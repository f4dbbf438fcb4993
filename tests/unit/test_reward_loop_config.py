"""Config checks of verl's reward loop (reward_model.use_reward_loop=true, reward_model.rollout.*, num_workers)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from test_config import make

from rlsp.checks.preflight_reward import reward_model_errors
from rlsp.config.describe import describe_placement
from rlsp.config.layout import RoleLayout, World
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_reward_model

LOOP = {"reward_model.enable": True, "reward_model.model.path": "/rm", "reward_model.use_reward_loop": True}


def test_reward_loop_layout_accepts_legacy_keys():
    # verl's commands keep the legacy worker's FSDP keys next to use_reward_loop=true; the loop does not read them.
    cfg = make(**LOOP, **{"reward_model.num_workers": 8, "reward_model.model.use_remove_padding": False,
                          "reward_model.ulysses_sequence_parallel_size": 3})
    layout = validate_config(cfg)
    assert layout.reward_model == RoleLayout(World(1, 2), tp=1)
    text = "\n".join(describe_placement(cfg, layout))
    assert "reward loop on the policy pool, 2 vllm pooling engine(s) of 1 worker(s) each" in text
    assert "rule scoring in 8 process(es)" in text


def test_reward_loop_tp_rules():
    both = {"actor_rollout_ref.rollout.tensor_model_parallel_size": 2, "reward_model.rollout.tensor_model_parallel_size": 2}
    assert validate_config(make(**LOOP, **both)).reward_model == RoleLayout(World(1, 2), tp=2)
    with pytest.raises(ValueError) as err:
        validate_config(make(**LOOP, **{"reward_model.rollout.tensor_model_parallel_size": 2}))
    assert ("reward_model.rollout.tensor_model_parallel_size=2 with "
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1 is not supported") in str(err.value)
    assert "legal value: 1" in str(err.value)
    # A tp-1 reward engine beside a tp-2 rollout engine: one process of its own per policy worker.
    layout = validate_config(make(**LOOP, **{"actor_rollout_ref.rollout.tensor_model_parallel_size": 2}))
    assert layout.reward_model == RoleLayout(World(1, 2), tp=1) and layout.reward_servers
    assert "reward_model" not in layout.roles_of("policy")
    assert "reward_model in processes of its own" in layout.describe()
    text = "\n".join(describe_placement(make(**LOOP, **{"actor_rollout_ref.rollout.tensor_model_parallel_size": 2}),
                                         layout))
    assert "reward loop in processes of their own beside the policy workers" in text
    assert not validate_config(make(**LOOP, **both)).reward_servers
    with pytest.raises(ValueError, match=r"legal value: 1 or 4"):
        validate_config(make(**LOOP, **{"trainer.n_gpus_per_node": 4, "actor_rollout_ref.rollout.tensor_model_parallel_size": 4,
                                        "reward_model.rollout.tensor_model_parallel_size": 2}))
    # With HF generate on the workers there is no vLLM rollout engine in the process: any divisor is legal.
    hf = {"actor_rollout_ref.rollout.name": "hf", "reward_model.rollout.tensor_model_parallel_size": 2}
    assert validate_config(make(**LOOP, **hf)).reward_model.tp == 2
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=3 must divide the 2 policy workers per node.*"
                                         r"legal values: \[1, 2\]"):
        validate_config(make(**LOOP, **{"actor_rollout_ref.rollout.name": "hf",
                                        "reward_model.rollout.tensor_model_parallel_size": 3}))


def test_reward_loop_refusals():
    with pytest.raises(ValueError) as err:
        validate_config(make(**LOOP, **{"reward_model.rollout.name": "sglang", "reward_model.rollout.dtype": "fp8",
                                        "reward_model.rollout.data_parallel_size": 2,
                                        "reward_model.rollout.gpu_memory_utilization": 1.5,
                                        "reward_model.rollout.max_model_len": 0}))
    text = str(err.value)
    for needle in ("reward_model.rollout.name='sglang' is not supported (serving the reward model with SGLang",
                   "reward_model.rollout.dtype='fp8'", "reward_model.rollout.data_parallel_size=2 is not supported",
                   "gpu_memory_utilization=1.5 must be a fraction in (0, 1]", "max_model_len=0 must be null"):
        assert needle in text
    for bad in (-1, True, "two"):
        with pytest.raises(ValueError, match=rf"reward_model.num_workers={bad!r} must be auto, 0 \(the policy workers "
                                             r"score\) or a count of scoring processes >= 1"):
            validate_config(make(**{"reward_model.num_workers": bad}))


def test_reward_loop_preflight(tmp_path):
    policy = build_tiny_model(TinyModelSpec(), str(tmp_path / "policy"))
    rm = build_tiny_reward_model(TinyModelSpec(max_position_embeddings=256), str(tmp_path / "rm"),
                                 chat_template="{{ messages }}")
    cfg = OmegaConf.structured(RLSPConfig)
    for key, value in {"actor_rollout_ref.model.path": policy, "reward_model.enable": True, "reward_model.model.path": rm,
                       "reward_model.use_reward_loop": True, "reward_model.model.input_tokenizer": None}.items():
        OmegaConf.update(cfg, key, value)
    assert reward_model_errors(cfg, validate_config(cfg)) == []  # the loop always re-renders: no tokenizer match needed
    OmegaConf.update(cfg, "reward_model.rollout.max_model_len", 512)
    assert reward_model_errors(cfg, validate_config(cfg)) == ["reward_model.rollout.max_model_len=512 exceeds the reward model's "
                                        "max_position_embeddings=256; legal: null (= 256) or at most 256"]
