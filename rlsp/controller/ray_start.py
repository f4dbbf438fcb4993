"""A private local Ray without the API server process Ray starts beside every head node.

With `include_dashboard=False` that process serves no dashboard, state or job API: it loads Ray's usage-
statistics module alone, and `ray.init` polls every 0.1 s until it has registered (0.8-1 s of every run's
start-up on 2 cores, plus ~0.8 s of CPU beside the workers' imports). A run's private Ray is reached only
by its own driver, so `without_api_server()` has Ray take the path it takes when that server could not be
started: no URL, no process. Clusters a run joins (`trainer.ray_address`) are not started here and keep
theirs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def without_api_server() -> Iterator[None]:
    """`ray.init(address="local", include_dashboard=False)` in this block starts no API server process."""
    from ray._private import services

    start = getattr(services, "start_api_server", None)
    if start is None:  # another Ray's internals: its own start-up
        yield
        return

    def skipped(include_dashboard: bool | None, *args: Any, **kwargs: Any) -> tuple[str, None]:
        if include_dashboard:  # a dashboard asked for: Ray's own start
            return start(include_dashboard, *args, **kwargs)
        return "", None

    services.start_api_server = skipped
    try:
        yield
    finally:
        services.start_api_server = start
