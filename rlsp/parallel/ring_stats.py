"""What one ring-attention call (rlsp/parallel/ring.py) adds to the micro-batch's stats counters.

Counters on the stats object (any object with these attributes; None counts nothing): ring_bytes_fwd/bwd and
ring_calls_fwd/bwd (bytes sent by this rank, calls), ring_blocks_computed / ring_blocks_skipped (K/V blocks with /
without a visible box), and the optional ring_blocks_not_sent / ring_bytes_not_sent (what direct sends of windowed
layers saved against the relay: rlsp/parallel/ring_direct.py).

Legend: T stream length, r ring size, Tr = T / r tokens of this rank, H heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from rlsp.parallel import ring_direct
from rlsp.parallel.ring_plan import RingPlan
from rlsp.parallel.ring_reference import acc_dtype


def count_sent(stats: Any, suffix: str, nbytes: int) -> None:
    """Add one call and its `nbytes` sent to ring_bytes_<suffix> / ring_calls_<suffix> (suffix: fwd | bwd)."""
    if stats is not None:
        setattr(stats, f"ring_bytes_{suffix}", getattr(stats, f"ring_bytes_{suffix}") + nbytes)
        setattr(stats, f"ring_calls_{suffix}", getattr(stats, f"ring_calls_{suffix}") + 1)


def count_blocks(stats: Any, plan: RingPlan, window: int | None) -> None:
    """Add this call's computed / skipped K/V blocks (steps with / without a visible box) to the stats
    ring_blocks_computed / ring_blocks_skipped counters (the plan derives them: `RingPlan.block_counts`), and the
    K/V blocks it does not send (direct sends of windowed layers: rlsp/parallel/ring_direct.py) to
    ring_blocks_not_sent."""
    if stats is not None:
        computed, skipped = plan.block_counts(window)
        stats.ring_blocks_computed += computed
        stats.ring_blocks_skipped += skipped
        if hasattr(stats, "ring_blocks_not_sent"):  # optional counter
            stats.ring_blocks_not_sent += ring_direct.unsent_blocks(plan, window)


def count_unsent(stats: Any, plan: RingPlan, relay_bytes: int, sent: int) -> None:
    """Add the bytes the relay would have sent beyond those sent (direct sends) to ring_bytes_not_sent (optional)."""
    if hasattr(stats, "ring_bytes_not_sent") and plan.ring_size > 1:
        stats.ring_bytes_not_sent += relay_bytes - sent


def relay_bytes(plan: RingPlan, k_THD: torch.Tensor, v_THD: torch.Tensor, backward: bool) -> int:
    """Bytes the relay sends in one call (rlsp/parallel/ring.py's docstring): (r-1) K/V blocks, plus their dK/dV
    accumulators in backward."""
    elems = k_THD.numel() + v_THD.numel()
    per_block = elems * k_THD.element_size() + (elems * acc_dtype(k_THD.dtype).itemsize if backward else 0)
    return (plan.ring_size - 1) * per_block
