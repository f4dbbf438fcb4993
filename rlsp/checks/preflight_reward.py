"""Preflight of the reward model (`reward_model.enable=true`): what needs its files, checked before workers have the run's config.

The directory must hold a config.json of a model type transformers knows and the reward model's own
tokenizer (both paths render or compare with it). The checkpoint must be a one-label *ForSequenceClassification model whose attention rlsp can shard at
the configured Ulysses degree; its tokenizer must match the policy's when `model.input_tokenizer` is
null (the rollout ids are then fed as they are); and rows fed as they are must fit its position range
(`reward_input_errors`, run only once the reward model's own files and the policy's tokenizer passed).
With the reward loop (use_reward_loop=true) samples are always re-rendered, and the engine's
max_model_len must fit the model's position range (verl's rule).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlsp.config.layout import ParallelLayout
from rlsp.data.rm_inputs import same_tokenizer
from rlsp.models.family_checks import check_sp_support
from rlsp.models.loading import read_model_config, tokenizer_problem
from rlsp.models.reward import check_reward_config

P = "reward_model."


def _reward_loop_errors(rm: DictConfig, config: object) -> list[str]:
    """The reward loop always re-renders samples in the model's format; its engine's length must fit the model."""
    errors = []
    try:
        check_reward_config(config)
    except ValueError as exc:
        errors.append(f"{P}model.path: {exc}")
    limit, length = getattr(config, "max_position_embeddings", None), rm.rollout.max_model_len
    if limit is not None and length is not None and length > limit:
        errors.append(f"{P}rollout.max_model_len={length} exceeds the reward model's max_position_embeddings={limit}; "
                      f"legal: null (= {limit}) or at most {limit}")
    return errors


def reward_model_in_use(cfg: DictConfig) -> bool:
    return bool(cfg.reward_model.enable and cfg.reward_model.model.path)


def reward_model_errors(cfg: DictConfig, layout: ParallelLayout | None) -> list[str]:
    """Every problem with the reward model's own files (none when it is off); its Ulysses degree is the
    layout's (`layout` None: the config's degrees are invalid, validation names them)."""
    rm = cfg.reward_model
    if not reward_model_in_use(cfg):
        return []
    path = rm.model.path
    if not os.path.isdir(path):
        return [f"{P}model.path={path!r} is not a local directory with a Hugging Face model"]
    try:
        config = read_model_config(f"{P}model.path", path)
    except ValueError as exc:
        return [str(exc)]
    # Both paths need the reward model's own tokenizer: the reward loop's engine renders with it, the
    # legacy worker compares it with the rows' tokenizer.
    missing = tokenizer_problem(f"{P}model.path", path)
    errors = [missing] if missing else []
    if rm.use_reward_loop:
        return errors + _reward_loop_errors(rm, config)
    uly = layout.reward_model.ulysses if layout is not None and layout.reward_model is not None else 1
    for check, key in ((check_reward_config, "model.path"), (lambda c: check_sp_support(c, uly),
                                                              "ulysses_sequence_parallel_size")):
        try:
            check(config)
        except ValueError as exc:
            errors.append(f"{P}{key}: {exc}")
    return errors


def reward_input_errors(cfg: DictConfig, policy_tokenizer: Callable[[], Any]) -> list[str]:
    """The legacy worker feeds rows tokenized by model.input_tokenizer (null: the policy's ids as they are);
    `policy_tokenizer()` loads the policy's (None: its files do not load, already named)."""
    rm, policy = cfg.reward_model, cfg.actor_rollout_ref.model.path
    if rm.use_reward_loop:  # the reward loop re-renders every sample in the reward model's own format
        return []
    config = read_model_config(f"{P}model.path", rm.model.path)
    source = rm.model.input_tokenizer
    if source and not os.path.isdir(source):
        return [f"{P}model.input_tokenizer={source!r} is not a local directory with a tokenizer"]
    if source and source != policy and (missing := tokenizer_problem(f"{P}model.input_tokenizer", source)):
        return [missing]  # the policy's own is checked with actor_rollout_ref.model.path
    errors: list[str] = []
    rows_tokenizer = AutoTokenizer.from_pretrained(source) if source and source != policy else policy_tokenizer()
    if rows_tokenizer is None:
        return errors
    same = same_tokenizer(rows_tokenizer, AutoTokenizer.from_pretrained(rm.model.path))
    if not source and not same:
        errors.append(f"{P}model.input_tokenizer=null feeds the policy's token ids to the reward model, but its tokenizer "
                      f"or chat template differs from the policy's; set it to the policy's tokenizer "
                      f"({policy}) to re-render each sample in the reward model's format")
    need, limit = cfg.data.max_prompt_length + cfg.data.max_response_length, getattr(config, "max_position_embeddings", None)
    if same and limit is not None and need > limit:
        errors.append(f"data.max_prompt_length + data.max_response_length = {need} exceeds the reward model's "
                      f"max_position_embeddings={limit}")
    return errors
