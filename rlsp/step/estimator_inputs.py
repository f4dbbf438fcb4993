"""What the advantage estimator gets from the config and the batch, and the start-up checks of it.

`advantage_inputs(batch, cfg)` is the driver's call of the one builder of the estimator's input record
(rlsp.algos.adv_columns.build_advantage_inputs): every setting from `algorithm.*` (`config_settings`; the
estimator's registration refuses one it does not read unless it is at its default), gdpo's reward components
from the reward function's per-row dicts (`reward_components`), and the batch's columns.

`estimator_errors(cfg)` is preflight's part for the estimator: settings it would ignore, and what each
estimator needs from the rest of the run (reward components for gdpo, the actor's sum of pi^2 for the
optimal token baselines, ...).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from rlsp.algos.adv_columns import build_advantage_inputs
from rlsp.algos.adv_inputs import ESTIMATOR_DEFAULTS, AdvantageInputs
from rlsp.algos.registry import estimator_uses, unused_settings, users_of
from rlsp.data.batch import Batch
from rlsp.step.baselines import baseline_errors
from rlsp.step.off_policy import reads_is_weights, uses_rollout_logprobs
from rlsp.workers.step_stage import COMPONENTS_KEY

# Estimator setting -> its config key.
SETTING_KEYS = {"norm_adv_by_std": "algorithm.norm_adv_by_std_in_grpo", "gamma": "algorithm.gamma",
                "lam": "algorithm.lam", "gdpo_reward_weights": "algorithm.gdpo_reward_weights"}


def config_settings(cfg: Any) -> dict[str, Any]:
    """The estimator settings of `cfg` (setting name -> value; lists as tuples)."""
    out = {}
    for name, key in SETTING_KEYS.items():
        value = OmegaConf.select(cfg, key)
        out[name] = tuple(value) if OmegaConf.is_list(value) or isinstance(value, list) else value
    return out


def advantage_inputs(batch: Batch, cfg: Any) -> AdvantageInputs:
    """The estimator's input record for `batch` under config `cfg` (see the module docstring)."""
    name = cfg.algorithm.adv_estimator
    keys = list(cfg.algorithm.gdpo_reward_keys or [])
    components = reward_components(batch, keys) if "reward_components" in estimator_uses(name) else None
    # is_weights: verl hands the optimal token baselines the rollout-correction weights
    return build_advantage_inputs(name, batch, batch.meta.get("uid"), config_settings(cfg), components=components,
                                  is_weights=reads_is_weights(cfg))


def reward_components(batch: Batch, keys: list[str]) -> dict[str, torch.Tensor]:
    """Each named reward component per row ([B] float64), from what the reward function returned
    (`reward_extra_info`, one dict per row); RuntimeError naming the row when a key is missing."""
    extras = batch.meta.get("reward_extra_info") or [None] * len(batch)
    out = {}
    for key in keys:
        values = []
        for row, extra in enumerate(extras):
            if not extra or key not in extra:
                raise RuntimeError(
                    f"algorithm.gdpo_reward_keys names {key!r}, but the reward function's output for row {row} "
                    f"(data_source={batch.meta['data_source'][row]!r}) has {sorted(extra or {})}: return a dict "
                    f"with 'score' and every key of algorithm.gdpo_reward_keys")
            value = extra[key]
            if not isinstance(value, (bool, int, float, np.number)) or not math.isfinite(float(value)):
                raise RuntimeError(f"reward component {key!r} of row {row} is {value!r}: need a finite number")
            values.append(float(value))
        out[key] = torch.tensor(values, dtype=torch.float64)
    return out


def set_stage_components(batch: Any, cfg: Any) -> tuple[str, ...]:
    """gdpo on the workers (rlsp.workers.step_stage): its reward components set on `batch` as the column
    `COMPONENTS_KEY` ([B, K] float64, one float per row and key, in algorithm.gdpo_reward_keys's order), and the
    keys returned for the stage's request; () and nothing set for an estimator that reads no components."""
    if "reward_components" not in estimator_uses(cfg.algorithm.adv_estimator):
        return ()
    keys = list(cfg.algorithm.gdpo_reward_keys or [])
    components = reward_components(batch, keys)
    batch.set(COMPONENTS_KEY, torch.stack([components[k] for k in keys], dim=-1))
    return tuple(keys)


def estimator_errors(cfg: Any) -> list[str]:
    """Every problem with the estimator's settings and what it needs from the run (preflight)."""
    name, errors = cfg.algorithm.adv_estimator, []
    for kw, value in unused_settings(name, **config_settings(cfg)).items():
        shown = list(value) if isinstance(value, tuple) else value
        errors.append(f"{SETTING_KEYS[kw]}={shown} has no effect with algorithm.adv_estimator={name!r}; leave it at "
                      f"{ESTIMATOR_DEFAULTS[kw]} or pick an estimator that uses it: {users_of(kw)}")
    keys = list(cfg.algorithm.gdpo_reward_keys or [])
    if "reward_components" not in estimator_uses(name) and keys:
        errors.append(f"algorithm.gdpo_reward_keys={keys} has no effect with algorithm.adv_estimator={name!r}; leave "
                      f"it empty or pick an estimator that uses it: {users_of('reward_components')}")
    return errors + baseline_errors(cfg) + gdpo_errors(cfg) + sum_pi_squared_errors(cfg)


def sum_pi_squared_errors(cfg: Any) -> list[str]:
    """The optimal token baselines need the actor's sum of pi^2 from its old-logprob pass; nothing else reads it."""
    name, spp = cfg.algorithm.adv_estimator, bool(cfg.actor_rollout_ref.actor.calculate_sum_pi_squared)
    needs = "sum_pi_squared_BR" in estimator_uses(name)
    if spp and not needs:
        return [f"actor_rollout_ref.actor.calculate_sum_pi_squared=true has no effect with algorithm.adv_estimator="
                f"{name!r}; leave it false or pick an estimator that reads it: {users_of('sum_pi_squared_BR')}"]
    if not needs:
        return []
    errors = []
    if not spp:
        errors.append(f"algorithm.adv_estimator={name!r} needs actor_rollout_ref.actor.calculate_sum_pi_squared=true "
                      "(the actor's old-logprob pass then also returns the sum of pi^2 per token)")
    if uses_rollout_logprobs(cfg):
        errors.append(f"algorithm.adv_estimator={name!r} needs the actor's old-logprob pass (old logprobs and sum of "
                      "pi^2), which the rollout logprobs replace here (async_training.use_rollout_log_probs or "
                      "algorithm.rollout_correction.bypass_mode): turn that off or pick another estimator")
    return errors


# Settings that change token_level_rewards, which gdpo does not read (its reward is the named components).
_REWARD_CHANGES = {"algorithm.use_kl_in_reward": "the KL penalty", "reward_model.enable": "the reward model's score",
                   "actor_rollout_ref.rollout.multi_turn.use_step_rewards": "tool step rewards",
                   "reward.reward_kwargs.overlong_buffer_cfg.enable": "the overlong penalty"}


def gdpo_errors(cfg: Any) -> list[str]:
    """What gdpo needs: named components (algorithm.gdpo_reward_keys), one weight per key if weights are
    given, and no other change to the token rewards (it would be silently left out)."""
    if "reward_components" not in estimator_uses(cfg.algorithm.adv_estimator):
        return []
    keys, weights, errors = list(cfg.algorithm.gdpo_reward_keys or []), cfg.algorithm.gdpo_reward_weights, []
    if not keys:
        errors.append("algorithm.adv_estimator='gdpo' needs algorithm.gdpo_reward_keys: the reward components (keys of "
                      "the dict the reward function returns) to normalise separately, e.g. "
                      "['accuracy_reward', 'format_reward']")
    if weights is not None and len(weights) != len(keys):
        errors.append(f"algorithm.gdpo_reward_weights={list(weights)} has {len(weights)} entries for "
                      f"{len(keys)} algorithm.gdpo_reward_keys {keys}: give one weight per key, or none (all 1)")
    for key, what in _REWARD_CHANGES.items():
        if OmegaConf.select(cfg, key):
            errors.append(f"{key}=true adds {what} to the token rewards, which algorithm.adv_estimator='gdpo' does "
                          "not read (its reward is the components in algorithm.gdpo_reward_keys); turn it off")
    return errors
