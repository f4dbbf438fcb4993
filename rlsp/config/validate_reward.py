"""Start-up check of the reward-model section (`reward_model.*`, verl's keys) and its layout.

With `reward_model.enable=true` a frozen sequence-classification model is placed on the policy
workers as the `reward_model` role, with a `RoleLayout` of its own over the policy pool (Ulysses
degree and fsdp_size; no ring or tensor parallelism, as in verl). What rlsp implements is verl's
legacy reward-model worker; the other forms verl has are refused by name: its reward loop
(`use_reward_loop=true`, the model behind an inference server, `num_workers` reward processes) and
reward managers other than "naive". With `enable=false` the section is not read (verl's rule).
The model itself (architecture, heads, tokenizer) is checked in rlsp.trainer.preflight.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlsp.config.choices import REWARD_MANAGERS, STRATEGIES, choice_error
from rlsp.config.layout import ParallelLayout, RoleLayout

P = "reward_model."


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_keys(rm: Any, errors: list[str]) -> None:
    if not rm.model.path:
        errors.append(f"{P}enable=true needs {P}model.path: a local *ForSequenceClassification checkpoint")
    for key, legal in (("reward_manager", REWARD_MANAGERS), ("strategy", STRATEGIES)):
        if (error := choice_error(P + key, rm[key], legal)) is not None:
            errors.append(error)
    if rm.num_workers != 1:
        errors.append(f"{P}num_workers={rm.num_workers} is not supported: verl's reward-loop worker processes are not "
                      "implemented; rlsp scores rule rewards in the driver and runs the reward model on every policy "
                      "worker (shard it with reward_model.ulysses_sequence_parallel_size); legal values: [1]")
    if rm.use_reward_loop:
        errors.append(f"{P}use_reward_loop=true is not supported: verl's reward loop (the reward model behind an "
                      "inference server) is not implemented; rlsp runs it as verl's legacy reward-model worker "
                      "does (FSDP on the policy workers); legal values: [false]")
    if not rm.model.use_remove_padding:
        errors.append(f"{P}model.use_remove_padding=false is not supported: rlsp always scores packed sequences "
                      "without padding (the same scores); legal values: [true]")
    for key in ("micro_batch_size_per_gpu", "forward_max_token_len_per_gpu"):
        if not isinstance(rm[key], int) or rm[key] < 1:
            errors.append(f"{P}{key}={rm[key]} must be an integer >= 1")


def check_reward_model(cfg: Any, layout: ParallelLayout | None, errors: list[str]) -> ParallelLayout | None:
    """The layout with the reward model's `RoleLayout` when it is enabled, after checking its keys."""
    rm = cfg.reward_model
    if not rm.enable:
        return layout
    n_err = len(errors)
    _check_keys(rm, errors)
    uly, size = rm.ulysses_sequence_parallel_size, rm.model.fsdp_config.fsdp_size
    if isinstance(uly, bool) or not isinstance(uly, int) or uly < 1:
        errors.append(f"{P}ulysses_sequence_parallel_size={uly!r} must be an integer >= 1")
        return layout
    if layout is None:
        return layout
    world = layout.policy
    if world.procs_per_node % uly:
        errors.append(f"{P}ulysses_sequence_parallel_size={uly} must divide the {world.procs_per_node} workers per node "
                      f"(its all-to-alls stay inside a node); legal values: {_divisors(world.procs_per_node)}")
    if size != -1 and (not isinstance(size, int) or size < 1 or world.world_size % size):
        errors.append(f"{P}model.fsdp_config.fsdp_size={size} must be -1 (shard over all {world.world_size} policy "
                      f"workers) or a divisor of {world.world_size}: legal values -1, {_divisors(world.world_size)}")
    if len(errors) > n_err:
        return layout
    return dataclasses.replace(layout, reward_model=RoleLayout(world, ulysses=uly, fsdp_size=size))
