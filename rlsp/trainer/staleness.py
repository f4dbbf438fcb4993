"""How far the asynchronous rollout pool may run ahead of the trainer (verl's staleness bound), read by
the async trainer (rlsp.trainer.async_trainer) when it submits generation units. The keys themselves
are checked at start-up in rlsp.config.validate_async.
"""

from __future__ import annotations

import math
from typing import Any


def max_units_ahead(cfg: Any) -> int:
    """verl's bound on generation between two weight syncs, in mini-batch units of ppo_mini_batch_size
    prompts: floor((1 + staleness_threshold) x trigger_parameter_sync_step x require_batches). With weights
    of version v (v updates = v x require_batches units consumed) the pool may have been asked for units
    with global index < v x require_batches + this bound."""
    a = cfg.async_training
    return math.floor((1.0 + float(a.staleness_threshold)) * int(a.trigger_parameter_sync_step)
                      * int(a.require_batches) + 1e-9)


def max_staleness(cfg: Any) -> int:
    """Most trainer updates a unit's generating policy may lag the trainer when it is trained on (the
    oldest version among its tokens, with partial rollouts): floor((max_units_ahead - 1) / require_batches)."""
    return (max_units_ahead(cfg) - 1) // int(cfg.async_training.require_batches)
