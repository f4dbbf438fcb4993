"""AdvantageInputs: the one record every advantage estimator takes.

An estimator is ``fn(inputs: AdvantageInputs) -> (advantages_BR, returns_BR)``. The record holds the
rows (rewards, mask, group ids), the optional per-row inputs some estimators need (critic values, a
greedy baseline reward, named reward components, the actor's logprobs and sum of squared
probabilities) and the settings from ``algorithm.*``. Adding an input means adding a field here, not
editing every estimator.

Every field after ``index`` except ``eps`` is an *estimator setting*: an estimator declares the ones it
reads when it registers (rlsp/algos/registry.py); any other must stay at its default here (None for the
optional inputs), so nothing a caller passes is silently ignored.

Shape legend: B rows (samples), R response length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Fields that are not settings: the rows every estimator gets, and eps (a numerical guard, not a choice).
_ROW_FIELDS = ("token_level_rewards_BR", "response_mask_BR", "index", "eps")


@dataclass(frozen=True)
class AdvantageInputs:
    token_level_rewards_BR: torch.Tensor
    response_mask_BR: torch.Tensor
    index: Sequence[Any] | np.ndarray | None = None  # one group id per row (samples of one prompt share it)
    eps: float = 1e-6
    # None: the rows are the whole batch. Else they are one shard of it and `reduce` sums a tensor over the
    # shards (rlsp.algos.whiten); only an estimator that declares it (batch-wide sums) takes it. An estimator
    # without batch-wide statistics takes a shard without it; one that reads groups needs them whole in a shard.
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # settings (algorithm.*)
    norm_adv_by_std: bool = True  # algorithm.norm_adv_by_std_in_grpo
    gamma: float = 1.0  # algorithm.gamma
    lam: float = 1.0  # algorithm.lam
    gdpo_reward_weights: tuple[float, ...] | None = None  # algorithm.gdpo_reward_weights (None: all 1)
    # optional per-row inputs
    values_BR: torch.Tensor | None = None  # critic values (gae)
    reward_baselines_B: torch.Tensor | None = None  # reward of the prompt's greedy response (remax)
    reward_components: Mapping[str, torch.Tensor] | None = None  # name -> [B] reward component (gdpo)
    old_logprobs_BR: torch.Tensor | None = None  # the actor's logprobs of the sampled tokens (otb)
    sum_pi_squared_BR: torch.Tensor | None = None  # sum over the vocabulary of pi^2 per token (otb)
    rollout_is_weights_BR: torch.Tensor | None = None  # rollout-correction IS weights (otb)

    def settings(self) -> dict[str, Any]:
        """Every estimator setting of this record (field name -> value), rows excluded."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _ROW_FIELDS}


# Defaults of the estimator settings; an estimator that ignores a setting insists on its default.
ESTIMATOR_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(AdvantageInputs) if f.name not in _ROW_FIELDS
}


def is_default(key: str, value: Any) -> bool:
    """Whether ``value`` equals setting ``key``'s default (None-ness for the optional inputs)."""
    default = ESTIMATOR_DEFAULTS[key]
    return value is None if default is None else bool(value == default)

