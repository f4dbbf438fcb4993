"""Registry of rule-based reward functions keyed by a dataset's `data_source`.

Every reward function has verl's signature
`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float` and returns a
score in [0, 1]. `score_batch` dispatches each sample to its data source's function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

ScoreFn = Callable[..., float]
_REWARDS: dict[str, ScoreFn] = {}


def register_reward(data_source: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator registering `fn` as the reward of `data_source`; a second, different one raises."""

    def decorator(fn: ScoreFn) -> ScoreFn:
        existing = _REWARDS.get(data_source)
        if existing is not None and existing is not fn:
            raise ValueError(f"data_source {data_source!r} already has a reward function: {existing!r}")
        _REWARDS[data_source] = fn
        return fn

    return decorator


def known_sources() -> list[str]:
    _load_builtin_rewards()
    return sorted(_REWARDS)


def get_reward_fn(data_source: str) -> ScoreFn:
    _load_builtin_rewards()
    if data_source not in _REWARDS:
        raise ValueError(
            f"no reward function for data_source {data_source!r}; known sources: {sorted(_REWARDS)}. "
            "Register one with @register_reward or set a custom reward function path"
        )
    return _REWARDS[data_source]


def score_batch(
    data_sources: Sequence[str],
    solutions: Sequence[str],
    ground_truths: Sequence[str],
    extra_infos: Sequence[Any] | None = None,
) -> list[float]:
    """Score every sample with its data source's reward function."""
    extras = list(extra_infos) if extra_infos is not None else [None] * len(solutions)
    lengths = {len(data_sources), len(solutions), len(ground_truths), len(extras)}
    if len(lengths) != 1:
        raise ValueError(
            f"score_batch needs equal lengths, got data_sources={len(data_sources)}, "
            f"solutions={len(solutions)}, ground_truths={len(ground_truths)}, extra_infos={len(extras)}"
        )
    return [
        float(get_reward_fn(src)(src, sol, truth, extra))
        for src, sol, truth, extra in zip(data_sources, solutions, ground_truths, extras)
    ]


def _load_builtin_rewards() -> None:
    # Importing the built-in modules runs their @register_reward decorators.
    from rlsp.rewards import arithmetic, calculator, geo3k, gsm8k, math, shapes  # noqa: F401, PLC0415
