"""Config checks for off-policy training: `async_training.*`, the rollout pool (`rollout.*`) and how
they combine with `algorithm.rollout_correction.*` (its option names are checked in preflight, against
the registries). `check_async` returns the rollout pool (a piece of the layout) when there is one.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.layout import World
from rlsp.config.run_spec import rollout_pool_enabled

ASYNC = "async_training."
ROLLOUT_IS_LEVELS = (None, "token", "sequence")


def check_off_policy(cfg: Any, errors: list[str]) -> None:
    """Where the loss's old logprobs come from, and the correction between the two policies."""
    a, rc = cfg.async_training, cfg.algorithm.rollout_correction
    if rc.rollout_is not in ROLLOUT_IS_LEVELS:
        errors.append(f"algorithm.rollout_correction.rollout_is={rc.rollout_is!r} is not supported; legal values: "
                      f"{list(ROLLOUT_IS_LEVELS)}")
    if not rc.rollout_is_threshold > 0:
        errors.append(f"algorithm.rollout_correction.rollout_is_threshold={rc.rollout_is_threshold} must be > 0")
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        errors.append("algorithm.rollout_correction.rollout_is_batch_normalize=true normalises importance weights: "
                      "set algorithm.rollout_correction.rollout_is (token | sequence)")
    if rc.rollout_rs is None and rc.rollout_rs_threshold is not None:
        errors.append(f"algorithm.rollout_correction.rollout_rs_threshold={rc.rollout_rs_threshold!r} has no effect "
                      "without algorithm.rollout_correction.rollout_rs")
    correcting = rc.rollout_is is not None or rc.rollout_rs is not None
    if a.compute_prox_log_prob and not a.use_rollout_log_probs:
        errors.append(f"{ASYNC}compute_prox_log_prob=true only applies with {ASYNC}use_rollout_log_probs=true (with "
                      "false the trainer always recomputes the old logprobs)")
    elif a.compute_prox_log_prob and rc.rollout_is is None:
        errors.append(f"{ASYNC}compute_prox_log_prob=true is decoupled PPO: the loss is clipped around the recomputed "
                      "proximal policy and weighted by pi_prox / pi_rollout; set algorithm.rollout_correction."
                      "rollout_is=token (AReaL's objective) or sequence")
    elif a.use_rollout_log_probs and not a.compute_prox_log_prob and correcting:
        errors.append(f"{ASYNC}use_rollout_log_probs=true without compute_prox_log_prob makes the rollout logprobs "
                      "the old logprobs, so the rollout correction's ratio is 1: drop algorithm.rollout_correction."
                      f"rollout_is/rollout_rs or set {ASYNC}compute_prox_log_prob=true")


def check_async(cfg: Any, errors: list[str]) -> World | None:
    """Validate async_training and the rollout pool; returns the pool when one is configured and valid."""
    a, pool = cfg.async_training, cfg.rollout
    n_err = len(errors)
    if not a.staleness_threshold >= 0:
        errors.append(f"{ASYNC}staleness_threshold={a.staleness_threshold} must be >= 0 (0 = synchronous)")
    for key in ("trigger_parameter_sync_step", "require_batches"):
        if int(a[key]) < 1:
            errors.append(f"{ASYNC}{key}={a[key]} must be >= 1")
    if int(pool.n_gpus_per_node) < 0 or int(pool.nnodes) < 1:
        errors.append(f"rollout.nnodes={pool.nnodes} must be >= 1 and rollout.n_gpus_per_node={pool.n_gpus_per_node} "
                      ">= 0 (0 = engines on the policy workers)")
    if len(errors) > n_err:
        return None
    if not rollout_pool_enabled(cfg):
        if a.partial_rollout:
            errors.append(f"{ASYNC}partial_rollout=true continues generations with weights pushed while they run: "
                          "that needs a rollout pool of its own (rollout.n_gpus_per_node > 0)")
        if a.staleness_threshold > 0 or a.trigger_parameter_sync_step > 1:
            errors.append(f"{ASYNC}staleness_threshold={a.staleness_threshold} / trigger_parameter_sync_step="
                          f"{a.trigger_parameter_sync_step} generate while the trainer trains: that needs a rollout "
                          "pool of its own (rollout.n_gpus_per_node > 0); colocated engines share the trainer's processes")
        return None
    _check_pool_batches(cfg, World(int(pool.nnodes), int(pool.n_gpus_per_node)), errors)
    _check_partial_rollout(cfg, errors)
    if cfg.trainer.critic_warmup > 0:
        errors.append(f"trainer.critic_warmup={cfg.trainer.critic_warmup} is not supported with a rollout pool "
                      "(policy versions count actor updates); set it to 0")
    return World(int(pool.nnodes), int(pool.n_gpus_per_node))


def _check_pool_batches(cfg: Any, world: World, errors: list[str]) -> None:
    a, d = cfg.async_training, cfg.data
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    if a.require_batches * mini != d.train_batch_size:
        errors.append(f"{ASYNC}require_batches={a.require_batches} x actor_rollout_ref.actor.ppo_mini_batch_size={mini} "
                      f"must equal data.train_batch_size={d.train_batch_size} (the prompts of one trainer step)")
    if mini % world.world_size:
        errors.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} (the prompts of one generation unit) must be "
                      f"divisible by the {world.world_size} rollout workers (rollout.nnodes x rollout.n_gpus_per_node)")


def _check_partial_rollout(cfg: Any, errors: list[str]) -> None:
    a = cfg.async_training
    if int(a.partial_rollout_segment_tokens) < 1:
        errors.append(f"{ASYNC}partial_rollout_segment_tokens={a.partial_rollout_segment_tokens} must be >= 1 (new "
                      "tokens per sample between two weight pick-ups)")
    tp = int(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
    if a.partial_rollout and tp > 1:
        errors.append(f"{ASYNC}partial_rollout=true with actor_rollout_ref.rollout.tensor_model_parallel_size={tp} is "
                      "not supported: each rank polls for new weights on its own, so the ranks of one tp engine could "
                      "switch weights at different segment boundaries; use tensor_model_parallel_size=1 or "
                      "partial_rollout=false")
