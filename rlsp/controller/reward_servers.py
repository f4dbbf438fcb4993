"""The reward loop's engines in processes of their own (verl's reward servers beside a TP rollout).

vLLM keeps one tensor-parallel degree per process, so where the policy workers' vLLM rollout engine
runs at tensor parallelism k > 1 a reward engine asking for 1 (verl's example reward-loop commands:
rollout TP 2 or 4, reward TP 1) cannot live in the same processes. Instead each policy worker gets a
reward server: a Ray actor on the worker's own placement-group bundle (the same node, no resources of
its own), with the worker's device (CUDA_VISIBLE_DEVICES) or CPU cores, holding one single-rank
vLLM pooling engine (rlsp.workers.roles.reward_loop.RewardLoopScorer). A batch is split into
contiguous chunks, one per server; each renders its rows exactly as the in-process reward loop does
and returns `rm_scores` [rows, R] (the score on the last response token), concatenated back in order.
With `reward_model.rollout.free_cache_engine` an engine sleeps between scoring calls, as the rollout
engine does, so the device is shared with the worker's own engines.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch
from omegaconf import OmegaConf
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsp.controller.resource_pool import ResourcePool
from rlsp.controller.step_data import StepData, from_batch, from_results
from rlsp.controller.traffic import TRAFFIC
from rlsp.controller.worker_group import RayWorkerGroup, gather_or_name
from rlsp.data.batch import Batch
from rlsp.utils.logging import get_logger
from rlsp.workers.columns import RowsSpec, assemble, row_report
from rlsp.workers.dispatch import declared_fields
from rlsp.workers.roles.reward_loop import RewardLoopScorer
from rlsp.workers.roles.reward_model import RewardModelRole, place_on_last_token
from rlsp.workers.worker import loopback_interface

log = get_logger("rlsp.controller")
RM_FIELDS = declared_fields(RewardModelRole, "compute_rm_score")  # a server keeps the reward-model role's contract


class RewardServer:
    """One reward engine in this process (wrapped as a Ray actor by `RewardServers`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        if (lo := loopback_interface()) is not None:  # vLLM's one-rank world meets over loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        self.scorer = RewardLoopScorer(OmegaConf.create(config), in_process_group=False)

    def compute_rm_score(self, spec: RowsSpec, *blocks: Batch) -> tuple[list[Any], Batch]:
        """`rm_scores` [B, R] of the rows `spec` builds (kept here) and their per-row reports for the driver
        (the reward-model role's contract)."""
        rows = assemble(spec, blocks)
        scores_B = torch.tensor(self.scorer.scores(rows), dtype=torch.float32)
        result = Batch.from_dict({"rm_scores": place_on_last_token(scores_B, rows["response_mask"])})
        report = row_report(rows.copy().update(result), RM_FIELDS.reports)
        return [ray.put(result)], report  # the scores stay in this process's object store (see RayWorker)


def server_envs(wg: RayWorkerGroup, env_vars: dict[str, str], infos: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Each server's environment: the workers' common one, its worker's CPU binding, and its worker's
    device (Ray sets none for a process that asks for no GPU; `infos` are the workers' init_worker results)."""
    envs = []
    for rank in range(wg.world_size):
        env = {**env_vars, **wg.rank_env(rank)}
        if infos[rank].get("visible_devices") is not None:
            env["CUDA_VISIBLE_DEVICES"] = infos[rank]["visible_devices"]
        envs.append(env)
    return envs


class RewardServers:
    """One `RewardServer` per bundle of `pool` (the policy workers' pool), placed with the worker of
    that rank and started with `envs[rank]` (see `server_envs`); `compute_rm_score` has the
    reward-model role's contract over the whole batch."""

    def __init__(self, pool: ResourcePool, config: dict[str, Any], envs: list[dict[str, str]]) -> None:
        remote_cls = ray.remote(RewardServer)
        self.servers = [remote_cls.options(
            num_cpus=0, num_gpus=0,  # the worker's bundle already holds the device and cores
            scheduling_strategy=PlacementGroupSchedulingStrategy(pool.pg, placement_group_bundle_index=pool.rank_to_bundle[rank]),
            runtime_env={"env_vars": envs[rank]}, name=f"rlsp-reward-{rank}-{id(self):x}",
        ).remote(config) for rank in range(pool.world_size)]
        gather_or_name([s.__ray_ready__.remote() for s in self.servers], self._name)
        log.info("%d reward engine processes started (one beside each policy worker)", len(self.servers))

    def _name(self, i: int) -> str:
        return f"reward engine process {i} of {len(self.servers)}"

    def compute_rm_score(self, data: StepData | Batch) -> StepData:
        """Contiguous chunks of the rows, at most one per server, each read by its server from the blocks
        that hold it; the scores stay with the servers, the driver gets the per-row reports."""
        data = from_batch(data) if isinstance(data, Batch) else data
        size = max(1, -(-len(data) // len(self.servers)))
        groups = [range(a, min(a + size, len(data))) for a in range(0, len(data), size)]
        stays, answers = [], []
        for server, rows in zip(self.servers, groups):
            spec, refs = data.spec(rows, RM_FIELDS.reads)
            TRAFFIC.send(spec)
            stay, answer = server.compute_rm_score.options(num_returns=2).remote(spec, *refs)
            stays.append(stay)
            answers.append(answer)
        TRAFFIC.call("reward_model.compute_rm_score", len(answers))
        TRAFFIC.wait()
        reports = gather_or_name(answers, self._name)
        held = ray.get(stays)
        TRAFFIC.receive(*reports, *held)
        return from_results(data, groups, [h[0] for h in held], reports, RM_FIELDS.writes, RM_FIELDS.writes)

    def shutdown(self) -> None:
        for s in self.servers:
            ray.kill(s)
        self.servers = []
