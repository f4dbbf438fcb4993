"""Start-up check of verl's reward loop (`reward_model.use_reward_loop=true`, keys `reward_model.rollout.*`).

The reward model is served by an in-process vLLM pooling engine (rlsp.rollout.vllm_reward) on the
policy workers, one engine per group of `tensor_model_parallel_size` consecutive workers: its ranks
all-reduce every layer, so a group stays inside a node. vLLM keeps its parallel groups per process,
so where the policy workers also host a vLLM rollout engine of another tensor-parallel degree, a
reward engine of tp 1 runs in a process of its own beside each worker (the layout's
`reward_servers`, rlsp.controller.reward_servers) and one of tp > 1 is refused. Engine features rlsp does not
use are refused by value, naming the legal one.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.choices import DTYPE_NAMES, REWARD_ENGINES, choice_error
from rlsp.config.layout import RoleLayout, World
from rlsp.utils.divisors import divisors

R = "reward_model.rollout."
TP_KEY = R + "tensor_model_parallel_size"


# (the reward model's split of the policy pool or None, the layout's reward_mode)
RewardPlacement = tuple[RoleLayout | None, str]
# (the rollout pool of its own or None, the rollout engines' tp degree)
RolloutPlacement = tuple[World | None, int]


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _check_engine_keys(r: Any, errors: list[str]) -> None:
    for key, legal in (("name", REWARD_ENGINES), ("dtype", DTYPE_NAMES)):
        if (error := choice_error(R + key, r[key], legal)) is not None:
            errors.append(error)
    for key in ("tensor_model_parallel_size", "max_num_seqs", "max_num_batched_tokens", "cpu_kvcache_space_gib",
                "prompt_length", "response_length"):
        if not _positive_int(r[key]):
            errors.append(f"{R}{key}={r[key]!r} must be an integer >= 1")
    if r.max_model_len is not None and not _positive_int(r.max_model_len):
        errors.append(f"{R}max_model_len={r.max_model_len!r} must be null (the reward model's "
                      "max_position_embeddings) or an integer >= 1")
    gmu = r.gpu_memory_utilization
    if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0 < gmu <= 1:
        errors.append(f"{R}gpu_memory_utilization={gmu!r} must be a fraction in (0, 1]")
    for key, legal, why in (
        ("data_parallel_size", 1, "one engine per tensor-parallel group of policy workers"),
        ("expert_parallel_size", 1, "expert parallelism is not implemented"),
        ("skip_tokenizer_init", False, "the engine tokenizes nothing, but verl requires its tokenizer"),
        ("cudagraph_capture_sizes", None, "the reward engine runs eagerly"),
        ("limit_images", None, "reward models are text-only in rlsp"),
    ):
        if r[key] != legal:
            errors.append(f"{R}{key}={r[key]!r} is not supported: {why}; legal value: {legal!r}")
    if r.engine_kwargs:
        errors.append(f"{R}engine_kwargs={dict(r.engine_kwargs)!r} is not supported: the engine is configured by "
                      f"the {R}* keys only; legal value: {{}}")


def check_reward_loop(cfg: Any, policy: World | None, rollout: RolloutPlacement,
                      errors: list[str]) -> RewardPlacement | None:
    """The reward engine's `RoleLayout` (tp only) and mode (model_vllm, or model_servers beside a rollout
    engine of another tp degree), after checking `reward_model.rollout.*`; None when that fails."""
    r = cfg.reward_model.rollout
    n_err = len(errors)
    _check_engine_keys(r, errors)
    if policy is None or len(errors) > n_err:
        return None
    tp, world, (pool, rollout_tp) = r.tensor_model_parallel_size, policy, rollout
    if world.procs_per_node % tp:
        errors.append(f"{TP_KEY}={tp} must divide the {world.procs_per_node} policy workers per node "
                      f"(trainer.n_gpus_per_node): an engine's ranks all-reduce every layer and stay inside a node; "
                      f"legal values: {divisors(world.procs_per_node)}")
    rollout_name = cfg.actor_rollout_ref.rollout.name
    beside_other_tp = pool is None and rollout_name == "vllm" and tp != rollout_tp
    if beside_other_tp and tp > 1:
        errors.append(f"{TP_KEY}={tp} with actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} "
                      f"is not supported: a reward engine of tp > 1 runs in the policy workers' processes next to the "
                      f"vLLM rollout engine, and vLLM keeps one tensor-parallel degree per process (tp 1 runs in a "
                      f"process of its own beside each worker); legal value: "
                      f"{' or '.join(map(str, sorted({1, rollout_tp})))}")
    if len(errors) > n_err:
        return None
    return RoleLayout(world, tp=tp), "model_servers" if beside_other_tp else "model_vllm"
