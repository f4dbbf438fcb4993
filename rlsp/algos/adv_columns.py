"""From a step's columns to the estimator's input record: the one place it is built.

The driver (outcome advantages from per-row values, rlsp.step.row_advantages, and token-level ones it
computes itself, rlsp.step.stage_advantages) and the policy workers' step stage (rlsp.workers.step_stage)
all call `build_advantage_inputs`: it takes any columns (a Batch, the driver's step after its reads, a dict)
and gives the estimator the settings, exactly the optional per-row inputs it declares (rlsp.algos.registry),
the rows' groups when it reads them and `reduce` when it declares batch-wide sums. `INPUT_COLUMNS` says which
column holds each optional input and what produces it; a missing column is an error naming both.

Shape legend: B rows, R response length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from rlsp.algos.adv_inputs import AdvantageInputs
from rlsp.algos.registry import estimator_uses, reads_groups

# Optional per-row input (a field of AdvantageInputs) -> (the column holding it, what produces that column).
INPUT_COLUMNS: dict[str, tuple[str, str]] = {
    "values_BR": ("values", "the critic (algorithm.adv_estimator=gae builds one)"),
    "reward_baselines_B": ("reward_baselines", "the greedy baseline rollout (rlsp.step.baselines)"),
    "old_logprobs_BR": ("old_logprobs", "the actor's logprob pass"),
    "sum_pi_squared_BR": ("sum_pi_squared", "the actor's logprob pass with "
                          "actor_rollout_ref.actor.calculate_sum_pi_squared=true"),
    "rollout_is_weights_BR": ("rollout_is_weights", "the rollout correction (algorithm.rollout_correction.rollout_is), "
                              "run before the advantages"),
}
# Read only when the caller asks (`is_weights`): the optimal token baselines also run without them.
ON_REQUEST = "rollout_is_weights_BR"


class Columns(Protocol):
    def __contains__(self, key: str) -> bool: ...
    def __getitem__(self, key: str) -> torch.Tensor: ...
    def keys(self) -> Any: ...


def input_columns(name: str, is_weights: bool = False) -> dict[str, str]:
    """Optional input -> column, for the inputs estimator `name` reads (the rollout-correction weights only
    with `is_weights`)."""
    uses = estimator_uses(name)
    return {f: col for f, (col, _) in INPUT_COLUMNS.items() if f in uses and (f != ON_REQUEST or is_weights)}


def build_advantage_inputs(name: str, columns: Columns, index: Sequence[Any] | np.ndarray | None,
                           settings: Mapping[str, Any], reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                           components: Mapping[str, torch.Tensor] | None = None,
                           is_weights: bool = False) -> AdvantageInputs:
    """Estimator `name`'s record for rows `columns` (token_level_rewards [B, R], response_mask [B, R] and the
    columns of `input_columns`), with group ids `index` (kept when it reads groups), `settings` (algorithm.*,
    rlsp.step.estimator_inputs.config_settings), `reduce` (kept when it declares batch-wide sums) and gdpo's
    named reward `components` (name -> [B])."""
    uses = estimator_uses(name)
    fields: dict[str, Any] = {}
    for field, column in input_columns(name, is_weights).items():
        if column not in columns:
            raise RuntimeError(f"advantage estimator {name!r} needs {column!r} from {INPUT_COLUMNS[field][1]}; the "
                               f"rows have {sorted(columns.keys())}")
        fields[field] = columns[column]
    if "reward_components" in uses:
        if components is None:
            raise RuntimeError(f"advantage estimator {name!r} needs the reward components named in "
                               "algorithm.gdpo_reward_keys (from the reward function's per-row dicts); none given")
        fields["reward_components"] = components
    if reads_groups(name) and index is None:
        raise RuntimeError(f"advantage estimator {name!r} needs each row's group (meta 'uid'); the rows have none")
    return AdvantageInputs(columns["token_level_rewards"], columns["response_mask"],
                           index if reads_groups(name) else None, reduce=reduce if "reduce" in uses else None,
                           **settings, **fields)
