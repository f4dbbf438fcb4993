"""WeightBoard: where the driver publishes the newest rollout weights for partial rollouts, and the
feed through which each rollout worker picks them up between generation segments.

Why not a `set_weights` call: a Ray actor runs its calls one after another, so a weight load sent to a
rollout worker waits until the `generate` running there returns, and cannot change the weights in the
middle of it. The board is a small Ray actor of its own holding one entry, (version, reference to the
weights object); publishing replaces the entry (the old weights object is freed once no worker reads it).
A rollout worker polls the board at every segment boundary: one small actor call; only when the
version is newer than the one it holds does it read the weights object (from the object store,
never through the driver). Nothing depends on the order in which Ray delivers calls.
"""

from __future__ import annotations

from typing import Any

import ray


class WeightBoard:
    """The newest published (version, [weights ref]); the ref is kept wrapped so Ray does not resolve it."""

    def __init__(self) -> None:
        self.version, self.weights = -1, [None]

    def publish(self, version: int, weights: list[Any]) -> None:
        if version <= self.version:
            raise ValueError(f"weights version {version} published after version {self.version}: versions must grow")
        self.version, self.weights = int(version), weights

    def latest(self) -> tuple[int, list[Any]]:
        return self.version, self.weights


class BoardFeed:
    """A rollout worker's view of a board (pickled into the worker): `poll()` returns (version, weights)
    when the board holds a version newer than the last one this feed returned, else None."""

    def __init__(self, board: Any) -> None:
        self.board, self.seen = board, -1

    def poll(self) -> tuple[int, Any] | None:
        version, (ref,) = ray.get(self.board.latest.remote())
        if version <= self.seen:
            return None
        self.seen = version
        return version, ray.get(ref)


def start_weight_board(name: str) -> Any:
    """The board actor (one CPU-less actor on the driver's node); `name` makes it findable in Ray's state."""
    return ray.remote(num_cpus=0)(WeightBoard).options(name=name).remote()
