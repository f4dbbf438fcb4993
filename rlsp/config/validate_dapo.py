"""Start-up checks of DAPO's two driver-side features (arXiv:2503.14476), with verl's keys:

* the reward manager `reward.reward_manager.name` (naive | dapo) and the dapo manager's overlong reward
  shaping `reward.reward_kwargs.{overlong_buffer_cfg.*, max_resp_len}` (verl's older spellings
  `reward_model.reward_manager` and `reward_model.overlong_buffer.*` are mapped onto these first, by
  rlsp.config.verl_compat);
* dynamic sampling `algorithm.filter_groups.{enable, metric, max_num_gen_batches}` and its generation batch
  `data.gen_batch_size`.

Every value that would be ignored or could not work is refused here, naming the key, the value and what is
legal. No torch import here.
"""

from __future__ import annotations

import math
from typing import Any

from rlsp.config.choices import FILTER_GROUP_METRICS, REWARD_MANAGERS, choice_error
from rlsp.config.run_spec import resolved_max_resp_len, rollout_pool_enabled

BUF = "reward.reward_kwargs.overlong_buffer_cfg."
MAX_LEN = "reward.reward_kwargs.max_resp_len"
FG = "algorithm.filter_groups."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_max_resp_len(cfg: Any, errors: list[str]) -> None:
    value, limit = cfg.reward.reward_kwargs.max_resp_len, cfg.data.max_response_length
    if value is None:
        return
    if not _is_int(value) or value != limit:
        # A larger limit never reaches the full penalty; a smaller one would push the penalty past
        # -penalty_factor (verl does not clip it): the generation limit is the only consistent value.
        errors.append(f"{MAX_LEN}={value!r} must equal data.max_response_length={limit} (the longest response that "
                      "can be generated is where the penalty reaches -penalty_factor) or be null (= that value)")


def _check_overlong_buffer(cfg: Any, errors: list[str]) -> None:
    buf, manager = cfg.reward.reward_kwargs.overlong_buffer_cfg, cfg.reward.reward_manager.name
    if not buf.enable:
        return
    if manager != "dapo":
        errors.append(f"{BUF}enable=true needs reward.reward_manager.name=dapo (got {manager!r}: the naive manager "
                      "does not shape rewards); legal: set the manager to dapo, or enable=false")
    if cfg.reward_model.enable:
        errors.append(f"{BUF}enable=true with reward_model.enable=true: the reward model's scores replace the rule "
                      "rewards and are not shaped (verl's rule); disable one of them")
    length, limit = buf.len, resolved_max_resp_len(cfg)
    if not _is_int(length) or not 1 <= length <= limit:
        errors.append(f"{BUF}len={length!r} must be an integer in [1, {limit}] (max_resp_len = "
                      "data.max_response_length): the buffer is the last `len` tokens before the limit")
    factor = buf.penalty_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 0:
        errors.append(f"{BUF}penalty_factor={factor!r} must be a finite number >= 0 (the penalty at max_resp_len)")


def _check_filter_groups(cfg: Any, errors: list[str]) -> None:
    fg = cfg.algorithm.filter_groups
    limit = fg.max_num_gen_batches
    if not _is_int(limit):
        errors.append(f"{FG}max_num_gen_batches={limit!r} must be an integer (<= 0: no limit)")
    if not fg.enable:
        return
    if (error := choice_error(FG + "metric", fg.metric, FILTER_GROUP_METRICS)) is not None:
        errors.append(error)
    n = cfg.actor_rollout_ref.rollout.n
    if n < 2:
        errors.append(f"{FG}enable=true compares the samples of a prompt: actor_rollout_ref.rollout.n={n} must be "
                      ">= 2 (a group of one is never filtered)")
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        errors.append(f"{FG}metric='seq_final_reward' with algorithm.use_kl_in_reward=true is not supported: rlsp "
                      "applies the in-reward KL penalty after filtering (old and reference logprobs are computed for "
                      "the kept rows only); legal: metric seq_reward / acc / score, or use_kl_in_reward=false "
                      "(seq_final_reward then equals seq_reward)")


def _check_gen_batch_size(cfg: Any, errors: list[str]) -> None:
    gen, train = cfg.data.gen_batch_size, cfg.data.train_batch_size
    if gen is None or gen == train:
        return
    if not _is_int(gen) or gen < 1:
        errors.append(f"data.gen_batch_size={gen!r} must be an integer >= 1 or null (= data.train_batch_size)")
    elif not cfg.algorithm.filter_groups.enable:
        errors.append(f"data.gen_batch_size={gen} differs from data.train_batch_size={train}: only dynamic sampling "
                      f"({FG}enable=true) generates batches of another size than it trains on; set it to null or {train}")
    elif rollout_pool_enabled(cfg):
        errors.append(f"data.gen_batch_size={gen} differs from data.train_batch_size={train}: the asynchronous rollout "
                      f"pool generates in units of a training batch; set it to null or {train}")


def check_dapo(cfg: Any, errors: list[str]) -> None:
    """Append one message per problem in the reward-manager, overlong-shaping and filter-groups keys."""
    name = cfg.reward.reward_manager.name
    if (error := choice_error("reward.reward_manager.name", name, REWARD_MANAGERS)) is not None:
        errors.append(error)
    _check_max_resp_len(cfg, errors)
    _check_overlong_buffer(cfg, errors)
    _check_filter_groups(cfg, errors)
    _check_gen_batch_size(cfg, errors)
