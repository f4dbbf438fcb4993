"""The training side's processes, started together: the policy pool (actor, reference, and the
rollout engines, critic and reward model where they are colocated), a critic pool of its own, and
the reward loop's engines in processes beside the policy workers (rlsp.controller.reward_servers).
`start_pool` is the one function that starts a worker pool — these and the asynchronous trainer's
rollout pool alike. Also the environment every worker process starts with, and the start-up check of
sharded forwards.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlsp.config.layout import ParallelLayout
from rlsp.controller.resource_pool import ResourcePool, default_cpus_per_worker
from rlsp.controller.reward_servers import RewardServers, server_envs
from rlsp.controller.worker_group import RayWorkerGroup
from rlsp.data.batch import Batch
from rlsp.engine.fsdp_engine import assert_sp_matches
from rlsp.utils.device import resolve_device_type
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.trainer")


def worker_env(cfg: DictConfig) -> dict[str, str]:
    """The environment of every worker process (and of the processes beside them)."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.actor_rollout_ref.rollout.cpu_kvcache_space_gib),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "RLSP_LOG_LEVEL": os.environ.get("RLSP_LOG_LEVEL", "INFO"),
    }


@dataclass
class TrainingWorkers:
    wg: RayWorkerGroup  # the policy workers
    critic_wg: RayWorkerGroup | None  # the policy workers when the critic is colocated; None without a critic
    reward_servers: RewardServers | None  # the reward loop's engines beside the policy workers
    infos: list[dict[str, Any]] = field(default_factory=list)  # each worker's init_worker result
    timings: dict[str, float] = field(default_factory=dict)  # startup/* seconds


def _workers_before(layout: ParallelLayout, group: str) -> int:
    """Workers of the pools started before `group`'s (policy, then a separate critic, then a rollout pool):
    on CPU each pool binds the cores after theirs, so pools sharing a node never share a core."""
    separate_critic = layout.role("critic").world_size if layout.has_critic and not layout.critic_colocated else 0
    return {"policy": 0, "critic": layout.world_size, "rollout": layout.world_size + separate_critic}[group]


@dataclass(frozen=True)
class PoolSettings:
    """What starting the worker pools needs from the config, read once on the driver's main thread (the
    pools may start on another thread while the main one still checks and resolves the config)."""

    device_type: str
    env: dict[str, str]

    @classmethod
    def of(cls, cfg: DictConfig) -> PoolSettings:
        return cls(resolve_device_type(cfg.trainer.device), worker_env(cfg))


def start_pool(settings: PoolSettings, layout: ParallelLayout, group: str) -> RayWorkerGroup:
    """Reserve the resources of one worker pool ('policy'; 'critic' or 'rollout' where the layout gives them
    a pool of their own) and start its processes. Not yet initialised: the caller waits for them
    (`wait_started`) and initialises each world (`init_workers`), so several pools can start at once."""
    world = layout.world_of(group)
    cpus = 1 if settings.device_type == "cuda" else default_cpus_per_worker(layout.total_workers)
    first_core = 0 if settings.device_type == "cuda" else _workers_before(layout, group) * cpus
    resources = ResourcePool(world.nnodes, world.procs_per_node, settings.device_type, cpus, name=group,
                             first_core=first_core)
    return RayWorkerGroup(resources, layout, group, env_vars=settings.env)


def start_training_pools(settings: PoolSettings, layout: ParallelLayout) -> list[RayWorkerGroup]:
    """The training side's pools, processes starting: the policy pool, then a critic pool of its own."""
    separate = layout.has_critic and not layout.critic_colocated
    return [start_pool(settings, layout, "policy")] + ([start_pool(settings, layout, "critic")] if separate else [])


def start_training_workers(cfg: DictConfig, layout: ParallelLayout, pools: list[RayWorkerGroup] | None = None
                           ) -> TrainingWorkers:
    """Start every process (unless `pools` were started already, from `start_training_pools`), and
    initialise the workers with the run's config (each world collectively)."""
    t0 = time.perf_counter()
    groups = pools or start_training_pools(PoolSettings.of(cfg), layout)
    wg = groups[0]
    critic_wg = groups[1] if len(groups) > 1 else wg if layout.has_critic else None
    for g in groups:  # processes up, worker module imported (all groups start at once)
        g.wait_started()
    t1 = time.perf_counter()
    config = OmegaConf.to_container(cfg, resolve=True)
    infos = [info for g in groups for info in g.init_workers(config)]  # each world initialises collectively
    servers = None
    if layout.reward_servers:  # the reward loop beside a rollout engine of another tp degree
        servers = RewardServers(wg.pool, config, server_envs(wg, worker_env(cfg), infos))
    return TrainingWorkers(wg, critic_wg, servers, infos, {"startup/worker_processes_s": t1 - t0,
                                                           "startup/worker_init_s": time.perf_counter() - t1})


def check_sharded_forwards(cfg: DictConfig, layout: ParallelLayout, wg: RayWorkerGroup,
                           critic_wg: RayWorkerGroup | None, batch: Batch) -> float:
    """Stop the run if a sharded forward (Ulysses, ring, tensor parallel) disagrees with an unsharded
    one on real rows: the actor, the reference where its layout differs, the critic, the reward model, the
    distillation teachers.
    Returns the largest difference seen."""
    tol = cfg.trainer.sp_self_check_tol
    ref_differs = layout.has_reference and layout.ref != layout.actor
    # The reward loop's engine is served like a rollout engine: no sharded-vs-unsharded forward to compare.
    scorer = wg if layout.reward_mode == "model_fsdp" else None
    worst = 0.0
    for role, group in (("actor", wg), ("ref", wg if ref_differs else None), ("critic", critic_wg),
                        ("reward_model", scorer), ("teacher", wg if layout.teachers else None)):
        degrees = layout.role(role) if group is not None else None
        if degrees is not None and (degrees.sp_size > 1 or degrees.tp > 1):
            what = {"critic": "value", "reward_model": "score"}.get(role, "logprob")
            diff = max(group.call(role, "sp_self_check", batch))
            assert_sp_matches(diff, tol, degrees.describe(), what=what)
            log.info("sp self-check passed (%s): max |d%s| = %.2e (sp=%d) [%s]", role, what, diff,
                     degrees.sp_size, degrees.describe())
            worst = max(worst, diff)
    return worst
