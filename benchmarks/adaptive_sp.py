"""Adaptive vs fixed Ulysses degree on a long-tailed length mix (reasoning-RL shaped), CPU + gloo.

One update (forward + backward over every micro-batch, the FSDP engine exactly as the actor uses it)
on a batch where most responses are short and a few are near the maximum, at the same per-rank token
budget: fixed sp runs every micro-batch over the whole Ulysses group (each rank a 1/sp sliver plus two
all-to-alls per layer); adaptive runs the short ones at degree 1, one per rank, and only the long
ones over the group. Both are exact (tests/distributed/test_adaptive_sp.py); this measures time.

Both engines live in the same worker processes and their updates alternate (fixed, adaptive, then
adaptive, fixed, ...), so load from other jobs on a shared machine hits both modes alike.

Model: random-init Qwen2, hidden 256, 8 q / 4 kv heads (head dim 32), 4 layers, vocab 1024, fp32.
Batch per dp group: 28 rows of 40-200 tokens and 4 of 1700-2000 (prompt 32). Budget 1024 tokens per
rank. Prints ONE JSON line: median (and least) seconds per update for each mode, the median CPU
seconds of the busiest rank's process (its work, which other jobs' load does not inflate), the speed-up (ratio
of the medians; `cpu_speedup` the same for CPU seconds), the median of the per-rep ratios (each rep runs the two modes back to back, so a
ratio sees one load), the 1-minute load average before and after, and with `--breakdown` one more update per
mode timed round by round on every rank (`rounds`: degree, the rank's tokens and sum of squared row
lengths, forward / backward seconds, seconds inside all-to-alls, and the seconds the rank's round
ended before the slowest rank's).
Usage: python benchmarks/adaptive_sp.py [--world 2] [--reps 5] [--breakdown]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _launch import layout_dims, run_distributed  # noqa: E402
from test_fsdp_engine import LOSS, policy_engine  # noqa: E402

from rlsp.data.batch import Batch  # noqa: E402
from rlsp.engine.fsdp_engine import FSDPEngine  # noqa: E402
from rlsp.engine.micro import plan_micro_batches  # noqa: E402
from rlsp.models.tiny import TinyModelSpec, build_tiny_model  # noqa: E402
from rlsp.workers.actor_loss import make_actor_loss  # noqa: E402

PROMPT, RESPONSE, BUDGET = 32, 2000, 1024
MODES = ("fixed", "adaptive")


def _batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    short = torch.randint(40, 200, (28,), generator=g).tolist()
    long = torch.randint(1700, 2000, (4,), generator=g).tolist()
    lens = short + long
    rows = len(lens)
    ids = torch.randint(3, 1024, (rows, PROMPT + RESPONSE), generator=g)
    mask = torch.zeros(rows, PROMPT + RESPONSE, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, : PROMPT + n] = 1
    resp = mask[:, PROMPT:].float()
    fields = {k: torch.randn(rows, RESPONSE, generator=g) * resp for k in ("old_logprobs", "ref_logprobs", "advantages")}
    return Batch.from_dict({"input_ids": ids * mask, "attention_mask": mask, "response_mask": resp, **fields})


def _update(engine: FSDPEngine, batch: Batch, loss_fn) -> tuple[float, float, dict[str, float]]:
    """Wall seconds of one update on this rank (started together on every rank), the most CPU seconds
    a rank's process spent on it (its work, whatever the load; waits that block cost none) and its
    metrics."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(batch, PROMPT, 1, loss_fn, BUDGET, temperature=1.0)
    wall, cpu = time.perf_counter() - t0, torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    return wall, float(cpu), metrics


def _rounds(engine: FSDPEngine, batch: Batch, loss_fn) -> list[dict]:
    """One update's micro-batch loop (what backward_batch runs, metrics aside), timed per round on this
    rank: (degree, tokens, sum of squared row lengths, forward s, backward s, all-to-all s, end time)."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    engine.optimizer.zero_grad(set_to_none=True)
    engine.module.train()
    dist.barrier()
    out = []
    for plan, rows in engine._micro_batches(batch, 1, BUDGET):
        t0 = time.perf_counter()
        micro = engine.prepare(rows, PROMPT, plan.degree)
        loss, _ = loss_fn(engine.forward(micro, temperature=1.0), micro)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        out.append({"degree": plan.degree or engine.dims.layout.ulysses,
                    "tokens": sum(lengths[i] for i in plan.rows) // (plan.degree or engine.dims.layout.ulysses),
                    "sq_tokens": sum(lengths[i] ** 2 for i in plan.rows),
                    "fwd_s": round(t1 - t0, 4), "bwd_s": round(t2 - t1, 4),
                    "a2a_s": round(micro.ctx.stats.a2a_seconds, 4), "end": t2})
    return out


def _breakdown(engine: FSDPEngine, batch: Batch, loss_fn) -> list[list[dict]]:
    """Per round, every rank's timings; `early_s`: how long before the slowest rank it finished the round."""
    mine = _rounds(engine, batch, loss_fn)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    table = []
    for k in range(len(mine)):
        last = max(r[k]["end"] for r in ranks)
        table.append([{**{key: v for key, v in r[k].items() if key != "end"}, "early_s": round(last - r[k]["end"], 4)}
                      for r in ranks])
    return table


def _time_modes(rank: int, world: int, path: str, reps: int, breakdown: bool) -> dict | None:
    batch = _batch()
    loss_fn = make_actor_loss(LOSS, float(batch["response_mask"].sum()))
    engines, out = {}, {}
    for mode in MODES:
        dims = layout_dims(ulysses=world, adaptive=mode == "adaptive")
        engines[mode] = policy_engine(path, dims)
        out[mode] = {"micro_batches": len(plan := plan_micro_batches(batch, 1, BUDGET, dims)),
                     "degrees": sorted({p.degree or world for p in plan}), "times": []}
        _update(engines[mode], batch, loss_fn)  # warm-up
    for rep in range(reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            seconds, cpu, metrics = _update(engines[mode], batch, loss_fn)
            out[mode]["times"].append(round(seconds, 4))
            out[mode].setdefault("cpu_times", []).append(round(cpu, 4))
            out[mode]["a2a_time_share"] = round(metrics["sp/a2a_time_share"], 4)
    pairs = [f / a for f, a in zip(out["fixed"]["times"], out["adaptive"]["times"])]  # back-to-back updates
    out["pair_speedup_median"] = round(statistics.median(pairs), 3)
    for mode in MODES:
        out[mode]["s_per_update"] = statistics.median(out[mode]["times"])
        out[mode]["s_min"] = min(out[mode]["times"])
        out[mode]["cpu_s_per_update"] = statistics.median(out[mode]["cpu_times"])
        if breakdown:
            out[mode]["rounds"] = _breakdown(engines[mode], batch, loss_fn)
    return out if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true", help="add a per-round, per-rank timing of each mode")
    a = parser.parse_args()
    spec = TinyModelSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=4096)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(spec, tmp)
        res = run_distributed(_time_modes, a.world, path, a.reps, a.breakdown, timeout_s=1800)[0]
    print(json.dumps({"benchmark": "adaptive_sp", "world": a.world, "budget_tokens_per_rank": BUDGET,
                      "worker_threads": 1, "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                      **res, "speedup": round(res["fixed"]["s_per_update"] / res["adaptive"]["s_per_update"], 3),
                      "cpu_speedup": round(res["fixed"]["cpu_s_per_update"] / res["adaptive"]["cpu_s_per_update"], 3)}))


if __name__ == "__main__":
    main()
