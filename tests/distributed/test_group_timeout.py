"""actor_rollout_ref.nccl_timeout (verl's key, seconds) reaches every process group of a worker: the default group
(`Worker._init_process_group`) and each mesh group `build_parallel_dims` creates, which torch would otherwise give
its backend default (30 min for gloo) instead of the default group's timeout."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from tests.distributed._launch import run_distributed

pytestmark = pytest.mark.distributed


def _timeout(group: dist.ProcessGroup) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _group_timeouts(rank: int, world: int, degrees: dict[str, int], seconds: int | None) -> list[float]:
    from rlsp.config.layout import RoleLayout, World
    from rlsp.parallel.mesh import build_parallel_dims

    layout = RoleLayout(World(1, world), **degrees)
    dims = build_parallel_dims(layout, "cpu", None if seconds is None else timedelta(seconds=seconds))
    groups = [*dims.mesh.get_all_groups(), *dims.fsdp_mesh.get_all_groups(),
              *(dims.tp_mesh.get_all_groups() if dims.tp_mesh is not None else []),
              *([dims.ring_dkv_group] if dims.ring_dkv_group is not None else []), *dims.ulysses_subgroups.values()]
    sizes = sorted({g.size() for g in groups})
    assert sizes[0] < world, sizes  # sub-groups were made (the default group alone would prove nothing)
    return [_timeout(g) for g in groups if g is not dist.group.WORLD]


@pytest.mark.parametrize("degrees", [{"ulysses": 2, "ring": 2}, {"ulysses": 2, "tp": 2}])
def test_every_mesh_group_gets_the_timeout(degrees):
    for timeouts in run_distributed(_group_timeouts, 4, degrees, 1234):
        assert timeouts and set(timeouts) == {1234.0}, timeouts
    # without it torch's gloo default (30 min), not the default group's: the setting is what changes them
    for timeouts in run_distributed(_group_timeouts, 4, degrees, None):
        assert set(timeouts) == {1800.0}, timeouts


def _default_group_timeout(rank: int, world: int, seconds: int) -> tuple[float, float]:
    from rlsp.config.schema import RLSPConfig
    from rlsp.workers.context import group_timeout
    from rlsp.workers.worker import Worker

    dist.destroy_process_group()  # the launcher's group: the worker makes its own, as in a Ray worker process
    cfg = OmegaConf.structured(RLSPConfig)
    cfg.actor_rollout_ref.nccl_timeout = seconds
    worker = Worker.__new__(Worker)
    worker.cfg, worker.rank, worker._store_socket = cfg, 0, None
    worker.world = type("OneNode", (), {"world_size": 1, "nnodes": 1})()
    addr, port = worker.rendezvous_address()
    worker._init_process_group("gloo", addr, port)
    return _timeout(dist.group.WORLD), group_timeout(cfg).total_seconds()


def test_the_default_group_gets_the_timeout():
    (got, configured), = run_distributed(_default_group_timeout, 1, 4321)
    assert got == configured == 4321.0
