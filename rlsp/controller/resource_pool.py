"""A placement group reserving one bundle per worker process (a GPU each, or CPU cores on CPU).

Ranks are handed out node by node: after the reservation the bundles are ordered by the node Ray put
them on, so consecutive ranks (a Ulysses x TP group) share a node. A placement that would make such a
group straddle nodes is refused with the per-node bundle counts (ring groups may span nodes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from rlsp.utils.logging import get_logger

log = get_logger("rlsp.controller")


@dataclass
class ResourcePool:
    nnodes: int
    procs_per_node: int
    device_type: str  # cpu | cuda
    cpus_per_worker: int = 1
    name: str = "policy"
    first_core: int = 0  # CPU: this pool's workers bind cores from here on (pools sharing a node do not overlap)
    pg: PlacementGroup | None = field(default=None, init=False)
    rank_to_bundle: list[int] = field(default_factory=list, init=False)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node

    def bundle(self) -> dict[str, float]:
        b = {"CPU": float(self.cpus_per_worker)}
        if self.device_type == "cuda":
            b["GPU"] = 1.0
        return b

    def create(self, node_local: tuple[int, ...] = (1,), timeout_s: float = 120.0) -> PlacementGroup:
        """Reserve the bundles; runs of `node_local` consecutive ranks (each size given) must share a node."""
        bundles = [self.bundle() for _ in range(self.world_size)]
        # one node: all bundles on the same node or none (a one-node run rendezvouses over loopback)
        self.pg = placement_group(bundles, strategy="STRICT_PACK" if self.nnodes == 1 else "SPREAD", name="")
        if not self.pg.wait(timeout_seconds=timeout_s):
            avail = ray.available_resources()
            self.release()
            raise RuntimeError(
                f"could not reserve {self.world_size} x {self.bundle()} for the {self.name} workers within "
                f"{timeout_s:.0f}s; the Ray cluster has {avail}. Lower trainer.n_gpus_per_node/nnodes or add resources."
            )
        self.rank_to_bundle = self._order_by_node(node_local)
        log.info("reserved %d %s worker bundles %s", self.world_size, self.name, self.bundle())
        return self.pg

    def _order_by_node(self, node_local: tuple[int, ...]) -> list[int]:
        nodes = self._bundle_nodes()
        order = sorted(range(self.world_size), key=lambda b: (nodes[b], b))
        for sp in node_local:
            if any(len({nodes[b] for b in order[i:i + sp]}) > 1 for i in range(0, self.world_size, sp)):
                counts = {n[:8]: nodes.count(n) for n in dict.fromkeys(nodes)}
                self.release()
                raise RuntimeError(f"the {self.name} bundles landed on nodes {counts}: a Ulysses x TP group of "
                                   f"{sp} ranks would span nodes; give every node a multiple of {sp} workers")
        return order

    def _bundle_nodes(self) -> list[str]:
        table = placement_group_table(self.pg)["bundles_to_node_id"]
        return [str(table[b]) for b in range(self.world_size)]

    def release(self) -> None:
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def default_cpus_per_worker(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)
