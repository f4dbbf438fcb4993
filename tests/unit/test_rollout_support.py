"""A model the rollout engine cannot serve on the device is refused before any worker has the run's config."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from transformers import LlamaConfig, Qwen2Config

from rlsp.checks.preflight import preflight
from rlsp.config.schema import RLSPConfig
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.rollout.support import VLLM_CPU_HEAD_DIMS, check_rollout_support, model_head_dim


def test_head_dim_16_refused_for_vllm_on_cpu_only() -> None:
    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)  # head_dim 16
    message = check_rollout_support(config, "vllm", "cpu")
    assert message is not None
    assert "head_dim=16" in message and "actor_rollout_ref.rollout.name=hf" in message
    assert str(list(VLLM_CPU_HEAD_DIMS)) in message
    assert check_rollout_support(config, "hf", "cpu") is None
    assert check_rollout_support(config, "vllm", "cuda") is None


def test_explicit_head_dim_wins_over_hidden_over_heads() -> None:
    # SmolLM2-like shape: 576 / 9 = 64; an explicit head_dim that differs from hidden/heads is used as is.
    assert model_head_dim(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)) == 64
    odd = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    assert model_head_dim(odd) == 32 and check_rollout_support(odd, "vllm", "cpu") is None
    assert check_rollout_support(LlamaConfig(hidden_size=576, num_attention_heads=9), "vllm", "cpu") is None


def test_preflight_refuses_before_workers_start(tmp_path) -> None:
    model = build_tiny_model(TinyModelSpec(hidden_size=64, intermediate_size=128), str(tmp_path / "model"))
    cfg = OmegaConf.structured(RLSPConfig)
    OmegaConf.update(cfg, "trainer.cache_dir", str(tmp_path / "cache"))
    OmegaConf.update(cfg, "trainer.device", "cpu")
    OmegaConf.update(cfg, "actor_rollout_ref.model.path", model)
    OmegaConf.update(cfg, "actor_rollout_ref.rollout.name", "vllm")
    with pytest.raises(ValueError, match=r"head_dim=16 .*use actor_rollout_ref.rollout.name=hf"):
        preflight(cfg)
    OmegaConf.update(cfg, "actor_rollout_ref.rollout.name", "hf")
    assert preflight(cfg).actor_rollout_ref.model.path == model
