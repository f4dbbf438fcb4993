"""Rewards: rule-based scoring functions keyed by data_source, their registry, custom function loading."""

from rlsp.rewards import arithmetic, gsm8k, math  # noqa: F401  (register the built-in rewards)
from rlsp.rewards.loader import load_custom_reward_fn
from rlsp.rewards.registry import get_reward_fn, known_sources, register_reward, score_batch

__all__ = ["get_reward_fn", "known_sources", "load_custom_reward_fn", "register_reward", "score_batch"]
