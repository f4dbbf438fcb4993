"""A placement group reserving one bundle per worker process (a GPU each, or CPU cores on CPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rlsp.utils.logging import get_logger

log = get_logger("rlsp.controller")


@dataclass
class ResourcePool:
    nnodes: int
    procs_per_node: int
    device_type: str  # cpu | cuda
    cpus_per_worker: int = 1

    def __post_init__(self) -> None:
        self.pg: PlacementGroup | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node

    def bundle(self) -> dict[str, float]:
        b = {"CPU": float(self.cpus_per_worker)}
        if self.device_type == "cuda":
            b["GPU"] = 1.0
        return b

    def create(self, timeout_s: float = 120.0) -> PlacementGroup:
        bundles = [self.bundle() for _ in range(self.world_size)]
        self.pg = placement_group(bundles, strategy="PACK")
        ready = self.pg.wait(timeout_seconds=timeout_s)
        if not ready:
            avail = ray.available_resources()
            raise RuntimeError(
                f"could not reserve {self.world_size} x {self.bundle()} within {timeout_s:.0f}s; the Ray "
                f"cluster has {avail}. Lower trainer.n_gpus_per_node/nnodes or add resources."
            )
        log.info("reserved %d worker bundles %s", self.world_size, self.bundle())
        return self.pg

    def release(self) -> None:
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def default_cpus_per_worker(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)
