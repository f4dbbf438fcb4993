"""What a sliding window saves ring attention: K/V blocks computed vs skipped, and score cells, for one packed
stream on a ring (rlsp/parallel/ring_plan.py, every rank's plan built offline; no process group, no kernels).

A block is one step's visiting K/V block on one rank (ring size x ring size per call): computed when some
query of the rank sees some of its keys under causality and the window, else skipped (its send still happens:
rlsp/parallel/ring.py). Score cells: query rows x keys the explicit path scores per call, summed over ranks
(each row chunk of ROW_CHUNK rows against its key band), with the window and for the same stream without it.

Prints one JSON line:
    .venv/bin/python benchmarks/ring_window.py --tokens 2048 --window 128 --ring 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlsp.parallel.ring_plan import ROW_CHUNK, RingPlan, offline_plans  # noqa: E402


def _score_cells(plan: RingPlan, window: int | None) -> int:
    cells = 0
    for blocks in plan.step_blocks(torch.device("cpu"), window):
        for box in blocks:
            rows = box.q1 - box.q0
            for r0 in range(0, rows, ROW_CHUNK):
                a, b = box.key_band(r0, min(r0 + ROW_CHUNK, rows))
                cells += (min(r0 + ROW_CHUNK, rows) - r0) * (b - a)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--ring", type=int, default=4)
    parser.add_argument("--segments", type=int, default=1, help="equal segments the stream is packed from")
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
        "sends_unchanged": True,
    }))


if __name__ == "__main__":
    main()
