"""The one builder of a run's `ParallelLayout`: every placement decision, taken once, from the config.

`build_layout(cfg, errors)` checks the worker pools and each training role's degrees, then asks the
validators that own the other placement decisions for their piece, in order:

    rollout pool          rlsp.config.validate_async.check_async         (async training: engines apart)
    rollout tp            rlsp.config.validate_rollout_tp.check_rollout_tp
    reward mode + model   rlsp.config.validate_reward.check_reward_model (and validate_reward_loop)
    teachers              rlsp.config.validate_distill.check_distillation
    reference             the KL loss or the KL penalty in the reward needs the frozen reference model

and constructs the layout once from all of them (no field is patched afterwards). Every problem goes
into `errors`; the layout is None only when the pools or the training degrees themselves are invalid.
No torch here.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.layout import CRITIC_ESTIMATORS, ParallelLayout, RoleLayout, World
from rlsp.config.validate_async import check_async
from rlsp.config.validate_distill import check_distillation
from rlsp.config.validate_reward import check_reward_model
from rlsp.config.validate_rollout_tp import check_rollout_tp
from rlsp.utils.divisors import divisors


def has_reference(cfg: Any) -> bool:
    """The frozen reference model is needed (and placed) for the KL loss or the KL penalty in the reward."""
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def _require(cond: bool, msg: str, errors: list[str]) -> None:
    if not cond:
        errors.append(msg)


def _check_world(prefix: str, nnodes: int, per_node: int, errors: list[str]) -> World | None:
    if nnodes < 1 or per_node < 1:
        errors.append(f"{prefix}nnodes={nnodes} and {prefix}n_gpus_per_node={per_node} must be >= 1")
        return None
    return World(nnodes, per_node)


def _role_degrees(cfg: Any, role: str) -> tuple[str, dict[str, Any]]:
    """(key prefix, the role's degrees) with the reference's unset degrees taken from the actor."""
    arr = cfg.actor_rollout_ref
    keys = ("ulysses_sequence_parallel_size", "ring_sequence_parallel_size", "tensor_model_parallel_size",
            "sequence_parallel", "sequence_parallel_adaptive")
    if role == "critic":
        fsdp = cfg.critic.model.fsdp_config
        return "critic.", {k: cfg.critic[k] for k in keys} | {"fsdp_size": fsdp.fsdp_size,
                                                              "ep": getattr(fsdp, "expert_parallel_size", 1)}
    actor = {k: arr.actor[k] for k in keys}
    if role == "actor":
        fsdp = arr.actor.fsdp_config
        return "actor_rollout_ref.actor.", actor | {"fsdp_size": fsdp.fsdp_size, "ep": getattr(fsdp, "expert_parallel_size", 1)}
    ref = {k: actor[k] if arr.ref[k] is None else arr.ref[k] for k in keys}
    fsdp = arr.ref.fsdp_config
    return "actor_rollout_ref.ref.", ref | {"fsdp_size": fsdp.fsdp_size, "ep": getattr(fsdp, "expert_parallel_size", 1)}


def _check_ep(prefix: str, ep: Any, d: dict[str, Any], ranks: int, errors: list[str]) -> int:
    """The role's expert-parallel degree (an `auto` that rlsp.config.auto left unresolved: 1), after naming what
    makes it illegal."""
    key = f"{prefix.replace('critic.', 'critic.model.')}fsdp_config.expert_parallel_size"
    ep = 1 if ep == "auto" else ep
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        errors.append(f"{key}={ep!r} must be auto or an integer >= 1 (a divisor of the role's {ranks} ranks)")
        return 1
    if ranks % ep:
        errors.append(f"{key}={ep} does not divide the role's {ranks} ranks (its expert-parallel groups are runs of "
                      f"{ep} consecutive ranks); legal values: {divisors(ranks)}")
    if ep > 1 and (d["tensor_model_parallel_size"] != 1 or d["sequence_parallel_adaptive"]):
        errors.append(f"{key}={ep} needs {prefix}tensor_model_parallel_size=1 (got {d['tensor_model_parallel_size']}) "
                      f"and {prefix}sequence_parallel_adaptive=false (got {d['sequence_parallel_adaptive']}); legal "
                      "with those: expert_parallel_size=1")
    return ep


def _check_role(cfg: Any, role: str, world: World, errors: list[str]) -> RoleLayout | None:
    """The role's layout over `world`, or None after naming every degree that does not fit it."""
    prefix, d = _role_degrees(cfg, role)
    uly, ring, tp = (d["ulysses_sequence_parallel_size"], d["ring_sequence_parallel_size"],
                     d["tensor_model_parallel_size"])
    n_err = len(errors)
    for key, val in (("ulysses_sequence_parallel_size", uly), ("ring_sequence_parallel_size", ring),
                     ("tensor_model_parallel_size", tp)):
        _require(isinstance(val, int) and val >= 1, f"{prefix}{key}={val} must be an integer >= 1", errors)
    if len(errors) > n_err:
        return None
    per_node, total = world.procs_per_node, world.world_size
    if uly * tp > per_node or per_node % (uly * tp):
        errors.append(f"{prefix}ulysses_sequence_parallel_size={uly} x tensor_model_parallel_size={tp} must divide "
                      f"the {per_node} workers per node (their all-to-alls and all-gathers stay inside a node); "
                      f"legal values: {divisors(per_node)} (for ulysses x tp)")
    elif total % (uly * ring * tp):
        errors.append(f"ulysses {uly} x ring {ring} x tp {tp} = {uly * ring * tp} ranks per data-parallel group "
                      f"does not divide the {total} workers ({prefix}ring_sequence_parallel_size={ring}); legal ring "
                      f"sizes here: {divisors(total // (uly * tp))}")
    fsdp_ranks = total // tp
    size = d["fsdp_size"]
    _require(size == -1 or (isinstance(size, int) and size >= 1 and fsdp_ranks % size == 0),
             f"{prefix.replace('critic.', 'critic.model.')}fsdp_config.fsdp_size={size} must be -1 (shard over all "
             f"{fsdp_ranks} non-TP ranks) or a divisor of {fsdp_ranks}: legal values -1, {divisors(fsdp_ranks)}",
             errors)
    ep = _check_ep(prefix, d["ep"], d, total, errors)
    adaptive = bool(d["sequence_parallel_adaptive"])
    if adaptive and (uly == 1 or ring > 1 or tp > 1):
        errors.append(f"{prefix}sequence_parallel_adaptive=true varies the Ulysses degree per micro-batch: it needs "
                      f"ulysses_sequence_parallel_size > 1 (got {uly}), ring_sequence_parallel_size=1 (got {ring}) "
                      f"and tensor_model_parallel_size=1 (got {tp})")
    if len(errors) > n_err:
        return None
    return RoleLayout(world, ulysses=uly, ring=ring, tp=tp, sequence_parallel=bool(d["sequence_parallel"]),
                      fsdp_size=size, adaptive=adaptive, ep=ep)


def _training_roles(cfg: Any, errors: list[str]) -> dict[str, Any] | None:
    """The policy pool and the training roles' splits (critic: its pool and colocation), or None."""
    t, critic = cfg.trainer, cfg.critic
    policy = _check_world("trainer.", t.nnodes, t.n_gpus_per_node, errors)
    if policy is None:
        return None
    actor, ref = _check_role(cfg, "actor", policy, errors), _check_role(cfg, "ref", policy, errors)
    if actor is None or ref is None:
        return None
    roles: dict[str, Any] = {"policy": policy, "actor": actor, "ref": ref}
    if cfg.algorithm.adv_estimator not in CRITIC_ESTIMATORS:
        return roles
    world = policy if critic.colocate else _check_world("critic.", critic.nnodes, critic.n_gpus_per_node, errors)
    mesh = None if world is None else _check_role(cfg, "critic", world, errors)
    return None if mesh is None else roles | {"critic": mesh, "critic_colocated": bool(critic.colocate)}


def build_layout(cfg: Any, errors: list[str]) -> ParallelLayout | None:
    """The run's layout, every field decided here at once (see the module docstring); problems into
    `errors` (a layout may still come back with them, for the checks that describe it)."""
    roles = _training_roles(cfg, errors)
    policy = roles["policy"] if roles is not None else None
    rollout = check_async(cfg, errors)
    rollout_tp = check_rollout_tp(cfg, rollout or policy, rollout is not None, errors)
    reward_model, reward_mode = check_reward_model(cfg, policy, (rollout, rollout_tp), errors)
    teachers = check_distillation(cfg, errors)
    if roles is None:
        return None
    return ParallelLayout(**roles, rollout=rollout, rollout_tp=rollout_tp, reward_model=reward_model,
                          reward_mode=reward_mode, teachers=teachers, has_reference=has_reference(cfg))
