"""Start-up check of the reward-model section (`reward_model.*`, verl's keys) and its layout.

With `reward_model.enable=true` a frozen sequence-classification model is placed on the policy
workers as the `reward_model` role. Two forms, as in verl:
- `use_reward_loop=false`, verl's legacy reward-model worker: FSDP2 with a `RoleLayout` of its own
  (Ulysses degree and fsdp_size; no ring or tensor parallelism);
- `use_reward_loop=true`, verl's reward loop: a vLLM pooling engine per group of
  `reward_model.rollout.tensor_model_parallel_size` consecutive policy workers, in their processes
  or (tp 1 beside a rollout engine of another tp degree) in processes of their own (checked in
  rlsp.config.validate_reward_loop). The legacy worker's FSDP keys are then not read (verl's rule).
The reward manager (`reward.reward_manager.name`, verl's older spelling `reward_model.reward_manager`) is
checked in rlsp.config.validate_dapo. With `enable=false` the section is not read
(verl's rule), but `num_workers` (rule scoring processes) is. The model itself (architecture, heads,
tokenizer) is checked in rlsp.checks.preflight.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.choices import STRATEGIES, choice_error
from rlsp.config.layout import RoleLayout, World
from rlsp.config.validate_reward_loop import RewardPlacement, RolloutPlacement, check_reward_loop
from rlsp.utils.divisors import divisors

P = "reward_model."


def _check_keys(rm: Any, errors: list[str]) -> None:
    if not rm.model.path:
        errors.append(f"{P}enable=true needs {P}model.path: a local *ForSequenceClassification checkpoint")
    if (error := choice_error(P + "strategy", rm.strategy, STRATEGIES)) is not None:
        errors.append(error)
    if rm.use_reward_loop:
        return  # the legacy worker's keys below are not read by the reward loop (verl's rule)
    if not rm.model.use_remove_padding:
        errors.append(f"{P}model.use_remove_padding=false is not supported: rlsp always scores packed sequences "
                      "without padding (the same scores); legal values: [true]")
    for key in ("micro_batch_size_per_gpu", "forward_max_token_len_per_gpu"):
        if not isinstance(rm[key], int) or rm[key] < 1:
            errors.append(f"{P}{key}={rm[key]} must be an integer >= 1")


def check_reward_model(cfg: Any, policy: World | None, rollout: RolloutPlacement,
                       errors: list[str]) -> RewardPlacement:
    """Where rewards are computed (the layout's `reward_mode` and the reward model's `RoleLayout`, None
    without one), after checking the keys; `policy` None: the policy pool is not valid itself."""
    rm = cfg.reward_model
    rules: RewardPlacement = (None, "rules")
    if not rm.enable:
        return rules
    n_err = len(errors)
    _check_keys(rm, errors)
    ep = getattr(rm.model.fsdp_config, "expert_parallel_size", 1)
    if ep not in (1, "auto"):
        errors.append(f"{P}model.fsdp_config.expert_parallel_size={ep!r}: the reward model runs every expert on every "
                      "rank (expert parallelism is for the actor, reference and critic); legal values: 1, auto")
    if rm.use_reward_loop:
        return check_reward_loop(cfg, policy, rollout, errors) or rules if len(errors) == n_err else rules
    uly, size = rm.ulysses_sequence_parallel_size, rm.model.fsdp_config.fsdp_size
    if isinstance(uly, bool) or not isinstance(uly, int) or uly < 1:
        errors.append(f"{P}ulysses_sequence_parallel_size={uly!r} must be an integer >= 1")
        return rules
    if policy is None:
        return rules
    world = policy
    if world.procs_per_node % uly:
        errors.append(f"{P}ulysses_sequence_parallel_size={uly} must divide the {world.procs_per_node} workers per node "
                      f"(its all-to-alls stay inside a node); legal values: {divisors(world.procs_per_node)}")
    if size != -1 and (not isinstance(size, int) or size < 1 or world.world_size % size):
        errors.append(f"{P}model.fsdp_config.fsdp_size={size} must be -1 (shard over all {world.world_size} policy "
                      f"workers) or a divisor of {world.world_size}: legal values -1, {divisors(world.world_size)}")
    if len(errors) > n_err:
        return rules
    return RoleLayout(world, ulysses=uly, fsdp_size=size), "model_fsdp"
