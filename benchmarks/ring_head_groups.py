"""Peak memory and time of ring attention's backward with its heads in 1 vs several groups
(rlsp/parallel/ring_heads.py), on one rank without communication (ring size 1: the rank's own block, so
the dq and own dK/dV accumulators; a real ring adds two more dK/dV accumulators per group).

Runs the real `ring_attention` forward, then times and measures its backward, with `acc_bytes_bound`
set so that the backward takes `--kv-per-pass` kv heads (and their q heads) per pass. The stream is
packed from segments of `--segment` tokens so the attention itself stays cheap on a CPU and the
O(tokens x heads x D) buffers dominate. One JSON line per config, each in a fresh subprocess:
  peak_mib: the process's peak resident set during the first backward above its resident set just
    before it (a 0.5 ms sampler of /proc/self/statm; blocks of 64 KiB and up are mmapped, so freed
    memory leaves the resident set); on CUDA max_memory_allocated above memory_allocated before;
  model_mib: what the backward allocates by design: the fp32 accumulators of one group (dq and the own
    dK/dV, ring size 1), its stacked K/V block, the q/k/v gradients in the input dtype and (several
    passes, below fp32) one group's gradients cast to it;
  first_bwd_s / bwd_s: the measured backward's seconds, the median of --repeats more.

    .venv/bin/python benchmarks/ring_head_groups.py --tokens 8192 --kv-per-pass 8 2 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ring_block import _peak_start, _Sampler, _sync  # noqa: E402

from rlsp.parallel.ring import ring_attention  # noqa: E402
from rlsp.parallel.ring_heads import acc_bytes  # noqa: E402
from rlsp.parallel.ring_plan import build_ring_plan  # noqa: E402


def _backward(cfg: dict, device: torch.device, dtype: torch.dtype, measure: bool = False) -> tuple[float, int]:
    """One forward (not measured) and a timed backward -> (seconds, its peak bytes above the memory before
    it when `measure`: the CPU's resident set sampled every 0.5 ms, or CUDA's max_memory_allocated)."""
    tokens, hq, hkv, d, seg = cfg["tokens"], cfg["hq"], cfg["hkv"], cfg["head_dim"], cfg["segment"]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(tokens, h, d, generator=gen, device=device, dtype=dtype) for h in (hq, hkv, hkv, hq))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    plan = build_ring_plan(None, torch.arange(0, tokens + 1, seg), tokens)
    n = cfg["kv_per_pass"]
    bound = acc_bytes(tokens, n * hq // hkv, n, d, 8 if dtype == torch.float64 else 4)
    out = ring_attention(q, k, v, plan, d**-0.5, acc_bytes_bound=bound)
    _sync(device)
    before, sampler = _peak_start(device)[0] if measure else 0, None
    if measure and device.type == "cpu":
        sampler = _Sampler()
        sampler.start()
    t0 = time.perf_counter()
    out.backward(do)
    _sync(device)
    seconds = time.perf_counter() - t0
    if not measure:
        return seconds, 0
    if sampler is None:
        return seconds, torch.cuda.max_memory_allocated() - before
    sampler.done.set()
    sampler.join()
    return seconds, sampler.peak - before


def run_one(cfg: dict) -> dict:
    device, dtype = torch.device(cfg["device"]), getattr(torch, cfg["dtype"])
    tokens, hq, hkv, d, n = cfg["tokens"], cfg["hq"], cfg["hkv"], cfg["head_dim"], cfg["kv_per_pass"]
    if hkv % n or tokens % cfg["segment"]:
        raise SystemExit(f"kv_per_pass={n} must divide hkv={hkv} and segment={cfg['segment']} the tokens")
    # the measured run comes first: a warm-up would leave the allocator's high-water mark behind
    first, peak = _backward(cfg, device, dtype, measure=True)
    times = [_backward(cfg, device, dtype)[0] for _ in range(cfg["repeats"])]
    e, m = dtype.itemsize, hq // hkv
    group = tokens * d * (n * m + 2 * n)  # elements of one group's dq, dk and dv
    # fp32 dq and own dK/dV of a group, its stacked K/V, the full gradients in the input dtype and, with
    # several passes below fp32, the group's gradients cast before they are written into those
    model = group * 4 + 2 * tokens * n * d * e + tokens * (hq + 2 * hkv) * d * e + (group * e if n < hkv and e < 4 else 0)
    return {**cfg, "passes": hkv // n, "peak_mib": round(peak / 2**20, 1), "model_mib": round(model / 2**20, 1),
            "first_bwd_s": round(first, 3),
            "bwd_s": round(statistics.median(times), 3), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=8192, help="Tr: tokens of the rank")
    ap.add_argument("--segment", type=int, default=512, help="tokens per packed sequence")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-per-pass", type=int, nargs="+", default=[8, 2, 1])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a config as JSON: run it in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))), flush=True)
        return
    for n in args.kv_per_pass:
        cfg = {"device": args.device, "dtype": args.dtype, "tokens": args.tokens, "segment": args.segment,
               "hq": args.hq, "hkv": args.hkv, "head_dim": args.head_dim, "kv_per_pass": n, "repeats": args.repeats}
        # large blocks always mmapped: freed memory leaves the resident set, so it tracks what is live
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        done = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)], capture_output=True, text=True,
                              env=env)
        print(done.stdout.strip() or json.dumps({**cfg, "error": done.stderr.strip()[-400:]}), flush=True)


if __name__ == "__main__":
    main()
