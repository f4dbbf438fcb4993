"""A run described in plain lines from its config and layout: where each role runs with which degrees,
how a step's batch is split, the token budgets and the schedule (what `rlsp.check` prints).

Arithmetic on the config only (no torch); the numbers are the ones validation checked and the
workers use.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.layout import ParallelLayout, RoleLayout
from rlsp.config.run_length import optimizer_steps_per_update, warmup_training_steps
from rlsp.config.validate_core import SINGLETON_ADVANTAGE


def group_of_one_note(cfg: Any) -> str | None:
    """The note for a group estimator run with rollout.n=1 (accepted, as in verl): what each sample's advantage
    is then; None otherwise."""
    estimator, n = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if n != 1 or estimator not in SINGLETON_ADVANTAGE:
        return None
    return (f"note: actor_rollout_ref.rollout.n=1 with algorithm.adv_estimator={estimator!r}: every group is one "
            f"sample, so its advantage is {SINGLETON_ADVANTAGE[estimator]}, as in verl")


def _nodes(first: int, count: int) -> str:
    return f"node {first}" if count == 1 else f"nodes {first}-{first + count - 1}"


def _degrees(role: RoleLayout) -> str:
    if role.fsdp_size == -1:
        shards = f"weights sharded over {role.fsdp_ranks} ranks (FSDP)"
    elif role.fsdp_size == 1:
        shards = "every rank holds all weights (fsdp_size=1: only gradients are reduced)"
    else:
        shards = f"weights sharded within groups of {role.fsdp_size}, {role.fsdp_ranks // role.fsdp_size} replicas (HSDP)"
    shared = f" | each row on {role.ranks_per_dp} ranks (ulysses x ring x tp)" if role.ranks_per_dp > 1 else ""
    if role.ep > 1:
        shared += (f" | MoE experts split over ep={role.ep} consecutive ranks (tokens dispatched by all-to-all), each "
                   f"share sharded over the {role.ep_replicas} rank(s) holding it")
    return f"{role.describe()} | {shards}{shared}"


def _micro(fixed: int, dynamic: bool, budget: int, role: RoleLayout, what: str) -> str:
    if dynamic:
        return f"{what}: micro-batches filled to {budget} tokens per rank ({budget * role.sp_size} per packed stream)"
    return f"{what}: micro-batches of {fixed} samples per rank"


def _scoring(cfg: Any) -> str:
    n = cfg.reward_model.num_workers
    return "in the policy workers" if n == 0 else f"in {n} process(es)"


def describe_placement(cfg: Any, layout: ParallelLayout) -> list[str]:
    """Pools, the roles on them and every role's degrees."""
    p = layout.policy
    lines = [f"layout: {layout.describe()}",
             f"policy pool: {p.nnodes} x {p.procs_per_node} = {p.world_size} workers on {_nodes(0, p.nnodes)}: "
             f"{', '.join(layout.roles_of('policy'))}",
             f"  actor:   {_degrees(layout.actor)}",
             f"  ref:     {_degrees(layout.ref)}" + ("" if layout.ref != layout.actor else " (the actor's layout)")]
    engines = layout.role("rollout")
    where = "on the policy pool" if layout.rollout is None else (
        f"own pool: {engines.world.nnodes} x {engines.world.procs_per_node} workers")
    lines.append(f"  rollout: {where}, {engines.world_size // engines.tp} {cfg.actor_rollout_ref.rollout.name} "
                 f"engine(s) of {engines.tp} worker(s) each")
    if layout.critic is not None:
        c = layout.critic
        where = ("colocated on the policy pool" if layout.critic_colocated
                 else f"own pool: {c.world.nnodes} x {c.world.procs_per_node} = {c.world_size} workers")
        lines.append(f"  critic:  {where} | {_degrees(c)}")
    reward_model = layout.reward_model
    if layout.reward_mode in ("model_vllm", "model_servers"):  # verl's reward loop
        r = cfg.reward_model.rollout
        where = ("in processes of their own beside the policy workers (the rollout engine uses another tp degree)"
                 if layout.reward_servers else "on the policy pool")
        lines.append(f"  reward model: reward loop {where}, {reward_model.world_size // reward_model.tp} "
                     f"{r.name} pooling engine(s) of {reward_model.tp} worker(s) each (dtype {r.dtype}, max_model_len "
                     f"{r.max_model_len or 'max_position_embeddings'}); rule scoring {_scoring(cfg)}")
    elif layout.reward_mode == "model_fsdp":
        lines.append(f"  reward model: on the policy pool | {_degrees(reward_model)}")
    if p.nnodes > 1:
        lines.append("  across nodes: ulysses x tp groups stay inside a node; ring and data-parallel groups span nodes")
    return lines


def describe_batches(cfg: Any, layout: ParallelLayout) -> list[str]:
    """How one step's prompts and samples are split, and the token budgets."""
    d, arr = cfg.data, cfg.actor_rollout_ref
    a, n, world = arr.actor, arr.rollout.n, layout.world_size
    samples = d.train_batch_size * n
    lines = [f"step: {d.train_batch_size} prompts x rollout.n={n} = {samples} samples; generation: "
             f"{d.train_batch_size // world} prompts per worker",
             f"sequences: prompt <= {d.max_prompt_length} + response <= {d.max_response_length} = "
             f"{d.max_prompt_length + d.max_response_length} tokens",
             f"actor update: mini-batches of {a.ppo_mini_batch_size} prompts ({a.ppo_mini_batch_size * n} samples, "
             f"{a.ppo_mini_batch_size * n // layout.dp_size} per dp rank) x ppo_epochs={a.ppo_epochs} = "
             f"{optimizer_steps_per_update(cfg, 'actor')} optimizer steps per step",
             "  " + _micro(a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu,
                           layout.actor, "train"),
             "  " + _micro(arr.rollout.log_prob_micro_batch_size_per_gpu, arr.rollout.log_prob_use_dynamic_bsz,
                           arr.rollout.log_prob_max_token_len_per_gpu, layout.actor, "old logprobs"),
             "  " + _micro(arr.ref.log_prob_micro_batch_size_per_gpu, arr.ref.log_prob_use_dynamic_bsz,
                           arr.ref.log_prob_max_token_len_per_gpu, layout.ref, "ref logprobs")]
    if note := group_of_one_note(cfg):
        lines.insert(1, note)
    if layout.critic is not None:
        c = cfg.critic
        lines += [f"critic update: mini-batches of {c.ppo_mini_batch_size} prompts x ppo_epochs={c.ppo_epochs} = "
                  f"{optimizer_steps_per_update(cfg, 'critic')} optimizer steps per step",
                  "  " + _micro(c.ppo_micro_batch_size_per_gpu, c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu,
                                layout.critic, "train"),
                  "  " + _micro(c.forward_micro_batch_size_per_gpu, c.use_dynamic_bsz, c.forward_max_token_len_per_gpu,
                                layout.critic, "values")]
    return lines


def describe_schedule(cfg: Any, num_prompts: int | None, explicit_steps: bool, has_critic: bool) -> list[str]:
    """Run length (verl's rule: `explicit_steps` says whether trainer.total_training_steps was set), the
    warm-up, validation and checkpoints."""
    t = cfg.trainer
    steps = t.total_training_steps
    if num_prompts is None:
        length = f"{steps} steps" if steps is not None else f"{t.total_epochs} epochs x (unknown) batches per epoch"
    else:
        per_epoch = num_prompts // cfg.data.train_batch_size
        rule = "trainer.total_training_steps" if explicit_steps else f"{t.total_epochs} epochs x {per_epoch} batches"
        length = f"{steps} steps ({rule}; {num_prompts} training prompts, {per_epoch} batches per epoch)"
    lines = [f"run: {length}"]
    optims = [("actor", cfg.actor_rollout_ref.actor.optim)] + ([("critic", cfg.critic.optim)] if has_critic else [])
    for role, optim in optims:
        if optim.lr_warmup_steps < 0 and optim.lr_warmup_steps_ratio > 0 and steps is None:
            lines.append(f"{role} learning rate: {optim.lr}, warm-up over {optim.lr_warmup_steps_ratio} of the run")
        elif warm := warmup_training_steps(optim, steps):
            lines.append(f"{role} learning rate: {optim.lr}, linear warm-up over {warm} training steps "
                         f"({warm * optimizer_steps_per_update(cfg, role)} optimizer steps)")
    val = f"every {t.test_freq} steps" if t.test_freq > 0 else "off"
    before = ", and before training" if t.test_freq > 0 and t.val_before_train else ""
    saves = f"every {t.save_freq} steps and " if t.save_freq > 0 else ""
    lines.append(f"validation: {val}{before}; checkpoints: {saves}at the last step")
    return lines
