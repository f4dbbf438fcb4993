"""Rollout: the RolloutEngine protocol and its vLLM / Hugging Face implementations (vllm imported lazily)."""

from rlsp.rollout.base import ENGINE_NAMES, RolloutEngine, RolloutOutput, SamplingConfig, build_rollout_engine

__all__ = ["ENGINE_NAMES", "RolloutEngine", "RolloutOutput", "SamplingConfig", "build_rollout_engine"]
