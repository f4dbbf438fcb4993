"""The training side's processes, started together: the policy pool (actor, reference, and the
rollout engines, critic and reward model where they are colocated), a critic pool of its own, and
the reward loop's engines in processes beside the policy workers (rlsp.controller.reward_servers).
`start_pool` starts a worker pool as a worker group (the asynchronous trainer's rollout pool); the
processes themselves start in rlsp.controller.worker_pools, also before the driver has imported torch
(rlsp.controller.ray_session). Also the start-up check of sharded forwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlsp.config.layout import ParallelLayout
from rlsp.controller.reward_servers import RewardServers, server_envs
from rlsp.controller.worker_group import RayWorkerGroup
from rlsp.controller.worker_pools import (
    PoolSettings,
    StartedPool,
    start_pool_processes,
    start_training_pools,
    worker_env,
)
from rlsp.data.batch import Batch
from rlsp.engine.fsdp_engine import assert_sp_matches
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.trainer")


@dataclass
class TrainingWorkers:
    wg: RayWorkerGroup  # the policy workers
    critic_wg: RayWorkerGroup | None  # the policy workers when the critic is colocated; None without a critic
    reward_servers: RewardServers | None  # the reward loop's engines beside the policy workers
    infos: list[dict[str, Any]] = field(default_factory=list)  # each worker's init_worker result
    timings: dict[str, float] = field(default_factory=dict)  # startup/* seconds


def start_pool(settings: PoolSettings, layout: ParallelLayout, group: str) -> RayWorkerGroup:
    """Reserve one worker pool and start its processes (`start_pool_processes`), as a worker group. Not yet
    initialised: the caller waits for them (`wait_started`) and initialises each world (`init_workers`)."""
    return _group(start_pool_processes(settings, layout, group), layout)


def _group(started: StartedPool, layout: ParallelLayout) -> RayWorkerGroup:
    return RayWorkerGroup(started.pool, layout, started.group, started.workers)


def start_training_workers(cfg: DictConfig, layout: ParallelLayout, started: list[StartedPool] | None = None
                           ) -> TrainingWorkers:
    """Start every process (unless `started`, from `start_training_pools` with this config's settings), and
    initialise the workers with the run's config (each world collectively)."""
    t0 = time.perf_counter()
    started = started or start_training_pools(PoolSettings.of(cfg), layout)
    groups = [_group(p, layout) for p in started]
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
