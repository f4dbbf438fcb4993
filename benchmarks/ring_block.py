"""Time and peak memory of one ring step's block math (forward + backward) on one rank: the fused
kernels (rlsp/parallel/ring_block.py) against the explicit score tiles (rlsp/parallel/ring_reference.py).

The step is taken from a real plan: one causal sequence of 2*Tr tokens on a ring of 2, ring rank 0
(chunks 0 and 3 of 4), so a rank holds Tr tokens ("keys" below). `own` is step 0 (its own K/V: two
causal Tr/2 squares and one full Tr/2 x Tr/2 tile), `visit` is step 1 (rank 1's K/V: the late chunk's
Tr/2 rows x all Tr keys, one full tile). The code run is the ring's own per-step functions
(`_attend` per box forward, `_block_grads` backward); no communication. Inputs q [Tr, hq, D],
k/v [Tr, hkv, D] and the upstream gradient are allocated before measuring.

One JSON line per config, each config in a fresh subprocess (so peaks do not carry over):
  step_s / fwd_s / bwd_s: medians over --repeats runs after one warm-up (the forward and the backward of
    each run timed separately; step = their sum);
  peak_mib: CUDA: max_memory_allocated - memory_allocated before the run; CPU: the process's peak
    resident set above its resident set before the run (max of ru_maxrss and a 0.5 ms sampler of
    /proc/self/statm), `rss_floor_mib` is how far ru_maxrss already was above the resident set before
    (import high-water: a CPU peak below it reads as that floor).

    .venv/bin/python benchmarks/ring_block.py --device cpu --keys 2048 4096 8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlsp.parallel import ring  # noqa: E402
from rlsp.parallel.ring_plan import build_ring_plan, zigzag_indices  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _Sampler(threading.Thread):
    """Peak resident set, sampled every 0.5 ms until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.done = _rss(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.0005):
            self.peak = max(self.peak, _rss())


def _blocks(keys: int, step: str, device: torch.device) -> list:
    total = 2 * keys
    plan = build_ring_plan(None, torch.tensor([0, total]), total)
    plan.ring_size, plan.ring_rank = 2, 0  # metadata only: no communication happens here
    plan.positions_RT = torch.stack([zigzag_indices(total, 2, i) for i in range(2)])
    return plan.step_blocks(device)[0 if step == "own" else 1]


def _step(q, kv, do, blocks, ctx, device: torch.device) -> tuple[float, float]:
    """One step's forward then backward -> (forward seconds, backward seconds)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    _sync(device)
    t0 = time.perf_counter()
    out = q.new_zeros(q.shape, dtype=acc)
    lse = q.new_full(q.shape[1::-1], float("-inf"), dtype=acc)
    for block in blocks:
        ring._attend(q, kv, block, ctx, out, lse)
    out = out.to(q.dtype)  # as the ring saves it
    _sync(device)
    t1 = time.perf_counter()
    delta = None if ctx.fused else (do.to(acc) * out.to(acc)).sum(-1).T.contiguous()
    ring._block_grads(do, q, kv, blocks, (out, lse, delta, ctx), q.new_zeros(q.shape, dtype=acc))
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_one(cfg: dict) -> dict:
    device, dtype = torch.device(cfg["device"]), getattr(torch, cfg["dtype"])
    keys, hq, hkv, d = cfg["keys"], cfg["hq"], cfg["hkv"], cfg["head_dim"]
    gen = torch.Generator(device=device).manual_seed(0)
    q, do = (torch.randn(keys, hq, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
    kv = torch.randn(2, keys, hkv, d, generator=gen, device=device, dtype=dtype)
    blocks = _blocks(keys, cfg["step"], device)
    fused = cfg["path"] == "fused"
    if fused and not ring.fused_supported(device, dtype):
        raise SystemExit(f"no fused kernel for {dtype} on {device}")
    kv_index = torch.arange(hq, device=device) // (hq // hkv)
    kernel_index = None if ring.native_gqa(device) else kv_index
    ctx = ring._Ctx(d**-0.5, kv_index, kernel_index, fused)

    before, floor = _peak_start(device)
    sampler = _Sampler() if device.type == "cpu" else None
    if sampler:
        sampler.start()
    first = sum(_step(q, kv, do, blocks, ctx, device))
    peak = _peak_end(device, before, sampler)
    fwd, bwd = zip(*(_step(q, kv, do, blocks, ctx, device) for _ in range(cfg["repeats"])))
    step = [f + b for f, b in zip(fwd, bwd)]
    tiles = sum(len(b.tiles) for b in blocks)
    return {**cfg, "tiles": tiles, "first_s": round(first, 4), "step_s": round(statistics.median(step), 4),
            "fwd_s": round(statistics.median(fwd), 4), "bwd_s": round(statistics.median(bwd), 4),
            "peak_mib": round(peak / 2**20, 1), "rss_floor_mib": round(floor / 2**20, 1),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def _peak_start(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated(), 0
    rss = _rss()
    return rss, max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss)


def _peak_end(device: torch.device, before: int, sampler: _Sampler | None) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() - before
    sampler.done.set()
    sampler.join()
    return max(sampler.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--keys", type=int, nargs="+", default=[2048, 4096, 8192], help="Tr: tokens a rank holds")
    ap.add_argument("--steps", nargs="+", choices=["own", "visit"], default=["own", "visit"])
    ap.add_argument("--paths", nargs="+", choices=["fused", "explicit"], default=["fused", "explicit"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hq", type=int, default=8)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a config as JSON: run it in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))), flush=True)
        return
    for keys in args.keys:
        for step in args.steps:
            for path in args.paths:
                cfg = {"device": args.device, "dtype": args.dtype, "keys": keys, "step": step, "path": path,
                       "hq": args.hq, "hkv": args.hkv, "head_dim": args.head_dim, "repeats": args.repeats}
                done = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)], capture_output=True,
                                      text=True)
                print(done.stdout.strip() or json.dumps({**cfg, "error": done.stderr.strip()[-400:]}), flush=True)


if __name__ == "__main__":
    main()
