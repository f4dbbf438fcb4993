"""Starting a worker pool's processes: the resources reserved and one process per rank, without torch in
the driver (rlsp.controller.worker_process), so that rlsp.controller.ray_session can start them while the
driver still imports torch and checks the config. What a pool needs from the config (`PoolSettings`) is
read before that, on the main thread; the device type there is a guess wherever `trainer.device=auto`
(nvidia-smi, rlsp.config.machine), checked against torch's answer before the pools are used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ray
from omegaconf import DictConfig

from rlsp.config.layout import ParallelLayout
from rlsp.config.machine import machine_facts
from rlsp.controller.resource_pool import ResourcePool, default_cpus_per_worker
from rlsp.controller.worker_process import start_worker_processes


def worker_env(cfg: DictConfig) -> dict[str, str]:
    """The environment of every worker process (and of the processes beside them)."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.actor_rollout_ref.rollout.cpu_kvcache_space_gib),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "RLSP_LOG_LEVEL": os.environ.get("RLSP_LOG_LEVEL", "INFO"),
        # verl's ray_kwargs.ray_init.runtime_env.env_vars: the job's too (rlsp.controller.ray_session), and the
        # user's value wins over rlsp's defaults above (names rlsp needs are refused at start-up)
        **{str(k): str(v) for k, v in cfg.ray_kwargs.ray_init.runtime_env.env_vars.items()},
    }


@dataclass(frozen=True)
class PoolSettings:
    """What starting the worker pools needs from the config: the device type and the workers' environment."""

    device_type: str
    env: dict[str, str]

    @classmethod
    def of(cls, cfg: DictConfig) -> PoolSettings:
        """The settings, with the device type this process computes on (torch's answer)."""
        from rlsp.utils.device import resolve_device_type  # torch

        return cls(resolve_device_type(cfg.trainer.device), worker_env(cfg))

    @classmethod
    def guess(cls, cfg: DictConfig) -> PoolSettings:
        """The settings without importing torch: `trainer.device=auto` by nvidia-smi (see the module docstring)."""
        return cls(machine_facts(cfg.trainer.device, 1).device, worker_env(cfg))


@dataclass
class StartedPool:
    """A pool whose processes are starting: its resources, group name and actor handles (rank order)."""

    group: str
    pool: ResourcePool
    workers: list[Any]

    def stop(self) -> None:
        """Kill the processes and release the resources (a pool no worker group adopted)."""
        for worker in self.workers:
            ray.kill(worker)
        self.pool.release()


def _workers_before(layout: ParallelLayout, group: str) -> int:
    """Workers of the pools started before `group`'s (policy, then a separate critic, then a rollout pool):
    on CPU each pool binds the cores after theirs, so pools sharing a node never share a core."""
    separate_critic = layout.role("critic").world_size if layout.has_critic and not layout.critic_colocated else 0
    return {"policy": 0, "critic": layout.world_size, "rollout": layout.world_size + separate_critic}[group]


def start_pool_processes(settings: PoolSettings, layout: ParallelLayout, group: str) -> StartedPool:
    """Reserve the resources of one worker pool ('policy'; 'critic' or 'rollout' where the layout gives them
    a pool of their own) and start its processes; not waited for."""
    world = layout.world_of(group)
    cpus = 1 if settings.device_type == "cuda" else default_cpus_per_worker(layout.total_workers)
    first_core = 0 if settings.device_type == "cuda" else _workers_before(layout, group) * cpus
    pool = ResourcePool(world.nnodes, world.procs_per_node, settings.device_type, cpus, name=group,
                        first_core=first_core)
    return StartedPool(group, pool, start_worker_processes(pool, layout, group, settings.env))


def start_training_pools(settings: PoolSettings, layout: ParallelLayout) -> list[StartedPool]:
    """The training side's pools, processes starting: the policy pool, then a critic pool of its own."""
    separate = layout.has_critic and not layout.critic_colocated
    return [start_pool_processes(settings, layout, g) for g in ("policy", *(("critic",) if separate else ()))]
