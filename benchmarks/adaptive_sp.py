"""Adaptive vs fixed Ulysses degree on a long-tailed length mix (reasoning-RL shaped), CPU + gloo.

One update (forward + backward over every micro-batch, the FSDP engine exactly as the actor uses it)
on a batch where most responses are short and a few are near the maximum, at the same per-rank token
budget: fixed sp runs every micro-batch over the whole Ulysses group (each rank a 1/sp sliver plus two
all-to-alls per layer); adaptive runs the short ones at degree 1, one per rank, and only the long
ones over the group. Both are exact (tests/distributed/test_adaptive_sp.py); this measures time.

Model: random-init Qwen2, hidden 256, 8 q / 4 kv heads (head dim 32), 4 layers, vocab 1024, fp32.
Batch per dp group: 28 rows of 40-200 tokens and 4 of 1700-2000 (prompt 32). Budget 1024 tokens per
rank. Prints ONE JSON line: median seconds per update for each mode and the speed-up.
Usage: python benchmarks/adaptive_sp.py [--world 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
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
from rlsp.engine.micro import plan_micro_batches  # noqa: E402
from rlsp.models.tiny import TinyModelSpec, build_tiny_model  # noqa: E402
from rlsp.workers.actor_loss import make_actor_loss  # noqa: E402

PROMPT, RESPONSE, BUDGET = 32, 2000, 1024


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


def _time_updates(rank: int, world: int, path: str, adaptive: bool, reps: int) -> dict | None:
    dims = layout_dims(ulysses=world, adaptive=adaptive)
    engine = policy_engine(path, dims)
    batch = _batch()
    loss_fn = make_actor_loss(LOSS, float(batch["response_mask"].sum()))
    plans = plan_micro_batches(batch, 1, BUDGET, dims)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        engine.optimizer.zero_grad(set_to_none=True)
        engine.backward_batch(batch, PROMPT, 1, loss_fn, BUDGET, temperature=1.0)
        times.append(time.perf_counter() - t0)
    if rank != 0:
        return None
    return {"s_per_update": statistics.median(times[1:]), "micro_batches": len(plans),
            "degrees": sorted({p.degree or world for p in plans})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    a = parser.parse_args()
    spec = TinyModelSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=4096)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(spec, tmp)
        fixed = run_distributed(_time_updates, a.world, path, False, a.reps, timeout_s=1800)[0]
        adaptive = run_distributed(_time_updates, a.world, path, True, a.reps, timeout_s=1800)[0]
    print(json.dumps({"benchmark": "adaptive_sp", "world": a.world, "budget_tokens_per_rank": BUDGET,
                      "torch_threads": torch.get_num_threads(), "fixed": fixed, "adaptive": adaptive,
                      "speedup": round(fixed["s_per_update"] / adaptive["s_per_update"], 3)}))


if __name__ == "__main__":
    main()
