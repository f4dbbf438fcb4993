"""A worker process that dies during a call is named as the run's cause, even when a peer's broken collective
("Connection reset by peer") reaches the driver first (rlsp.controller.worker_group.gather_or_name).

Real Ray actors in a private local Ray: one raises the error a gloo peer raises when its partner vanishes, another
ends its process mid-call (as a killed or out-of-memory worker does) a moment later.
"""

from __future__ import annotations

import os
import time

import pytest
import ray

from rlsp.controller.worker_group import PEER_DEATH_GRACE_S, WorkerDiedError, gather_or_name

pytestmark = pytest.mark.e2e
BROKEN = "Connection reset by peer"


@ray.remote(num_cpus=0)
class Peer:
    def broken_collective(self, after_s: float) -> None:
        time.sleep(after_s)
        raise RuntimeError(f"[gloo/transport/tcp/pair.cc] Read error: {BROKEN}")

    def die(self, after_s: float) -> None:
        time.sleep(after_s)
        os._exit(1)

    def answer(self) -> int:
        return 1


@pytest.fixture(scope="module")
def peers():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _name(index: int) -> str:
    return f"worker rank {index}"


def test_a_death_behind_a_broken_collective_is_the_cause(peers):
    survivor, victim = Peer.remote(), Peer.remote()
    ray.get([survivor.answer.remote(), victim.answer.remote()])  # both processes up before the call
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1 died"):
        gather_or_name([survivor.broken_collective.remote(0.0), victim.die.remote(1.0)], _name)
    assert time.monotonic() - t0 < PEER_DEATH_GRACE_S + 30  # found within the grace, not after a hang


def test_a_failure_without_a_death_is_its_own_cause(peers):
    failing, healthy = Peer.remote(), Peer.remote()
    with pytest.raises(ray.exceptions.RayTaskError, match=BROKEN):
        gather_or_name([failing.broken_collective.remote(0.0), healthy.answer.remote()], _name)
