"""What a sliding window saves ring attention: K/V blocks computed vs skipped, blocks and bytes sent, score cells,
for one packed stream on a ring (rlsp/parallel/ring_plan.py, every rank's plan built offline), and with `--run` the
measured bytes and time of ring_attention itself on gloo (one process per ring rank).

A block is one step's visiting K/V block on one rank (ring size x ring size per call): computed when some
query of the rank sees some of its keys under causality and the window, else skipped. Sent: a windowed layer sends a
block only to the ranks that see it (rlsp/parallel/ring_direct.py, `RingPlan.step_needs`); the relay (full layers)
sends r - 1 blocks per rank and call. Bytes: forward K/V blocks (Tr x hkv x 2D x element size each). Score cells:
query rows x keys the explicit path scores per call, summed over ranks (each row chunk of ROW_CHUNK rows against its
key band), with the window and for the same stream without it.

`--run`: ring_attention forward + backward (fp32, hq / hkv heads of dim D, random q/k/v) three ways on the same
stream: windowed with direct sends, windowed forced through the relay (every block travels), and without the window
(plain causal, relay, fused kernels); SPStats bytes sent (forward, backward) and the median seconds of `--repeats`.

Prints one JSON line:
    .venv/bin/python benchmarks/ring_window.py --tokens 2048 --window 128 --ring 4
    .venv/bin/python benchmarks/ring_window.py --tokens 8192 --window 256 --ring 4 --run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed")]
from rlsp.parallel.ring_plan import ROW_CHUNK, RingPlan, offline_plans  # noqa: E402

HEADS, HEAD_DIM = (8, 4), 64


def _score_cells(plan: RingPlan, window: int | None) -> int:
    cells = 0
    for blocks in plan.step_blocks(torch.device("cpu"), window):
        for box in blocks:
            rows = box.q1 - box.q0
            for r0 in range(0, rows, ROW_CHUNK):
                a, b = box.key_band(r0, min(r0 + ROW_CHUNK, rows))
                cells += (min(r0 + ROW_CHUNK, rows) - r0) * (b - a)
    return cells


def _blocks_sent(plans: list[RingPlan], window: int | None) -> int:
    """K/V blocks sent per forward call over the ring: direct sends of a windowed layer, else the relay's r(r-1)."""
    r = len(plans)
    needs = plans[0].step_needs(window)
    if window is None or all(all(row) for row in needs):
        return r * (r - 1)
    return sum(1 for i in range(r) for s in range(1, r) if needs[i][s])


def _run_worker(rank: int, world: int, args: argparse.Namespace, cu: torch.Tensor) -> dict[str, Any]:
    import torch.distributed as dist

    from rlsp.parallel import ring_direct
    from rlsp.parallel.ring import ring_attention
    from rlsp.parallel.ring_plan import build_ring_plan, zigzag_indices
    from rlsp.parallel.ulysses import SPStats

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    tr = args.tokens // world
    q, do = (torch.randn(tr, HEADS[0], HEAD_DIM, generator=gen) for _ in range(2))
    k, v = (torch.randn(tr, HEADS[1], HEAD_DIM, generator=gen) for _ in range(2))
    out = {}
    relay_only = ring_direct.applies
    for name, window in (("window_direct", args.window), ("window_relay", args.window), ("no_window", None)):
        ring_direct.applies = (lambda plan, w: False) if name == "window_relay" else relay_only
        times, stats = [], None
        for _ in range(args.repeats):
            plan = build_ring_plan(dist.group.WORLD, cu, args.tokens)
            assert plan.positions_RT[rank].equal(zigzag_indices(args.tokens, world, rank))
            stats = SPStats()
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            dist.barrier()
            t0 = time.perf_counter()
            ring_attention(qq, kk, vv, plan, HEAD_DIM**-0.5, stats=stats, window=window).backward(do)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out[name] = {"seconds": round(statistics.median(times), 4), "bytes_fwd": stats.ring_bytes_fwd,
                     "bytes_bwd": stats.ring_bytes_bwd, "blocks_not_sent": stats.ring_blocks_not_sent}
    ring_direct.applies = relay_only
    return out


def _measured(args: argparse.Namespace, cu: torch.Tensor) -> dict[str, Any]:
    from _launch import run_distributed

    per_rank = run_distributed(_run_worker, args.ring, args, cu, timeout_s=1800)
    return {name: {"seconds": max(r[name]["seconds"] for r in per_rank),
                   "bytes_sent": sum(r[name]["bytes_fwd"] + r[name]["bytes_bwd"] for r in per_rank),
                   "bytes_fwd": sum(r[name]["bytes_fwd"] for r in per_rank),
                   "blocks_not_sent_fwd": sum(r[name]["blocks_not_sent"] for r in per_rank)}
            for name in per_rank[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--ring", type=int, default=4)
    parser.add_argument("--segments", type=int, default=1, help="equal segments the stream is packed from")
    parser.add_argument("--run", action="store_true", help="also run ring_attention on gloo and measure")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cu = torch.linspace(0, args.tokens, args.segments + 1).round().to(torch.int32)
    plans = offline_plans(cu, args.tokens, args.ring)
    per_rank = [plan.block_counts(args.window) for plan in plans]
    plain = [plan.block_counts(None) for plan in plans]
    print(json.dumps({
        "tokens": args.tokens, "window": args.window, "ring": args.ring, "segments": args.segments,
        "chunk_tokens": args.tokens // (2 * args.ring),
        "blocks_computed": sum(c for c, _ in per_rank), "blocks_skipped": sum(s for _, s in per_rank),
        "blocks_per_rank": [list(x) for x in per_rank],
        "blocks_computed_without_window": sum(c for c, _ in plain),
        "score_cells": sum(_score_cells(p, args.window) for p in plans),
        "score_cells_without_window": sum(_score_cells(p, None) for p in plans),
        "blocks_sent": _blocks_sent(plans, args.window), "blocks_sent_without_window": _blocks_sent(plans, None),
        "block_bytes_fp32": (args.tokens // args.ring) * HEADS[1] * 2 * HEAD_DIM * 4,
        "measured": _measured(args, cu) if args.run else None,
    }))


if __name__ == "__main__":
    main()
