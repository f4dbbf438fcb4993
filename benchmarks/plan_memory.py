"""The layout planner's memory model against measured peaks of real engine steps (CPU, gloo).

For each layout a tiny Qwen2 (hidden 256, 8 q / 4 kv heads of dim 32, MLP 768, 4 layers, vocab 4096,
untied output layer) is trained by rlsp's FSDP2 engines as the policy worker builds them: a trainable
actor (fp32 master weights, AdamW) next to a frozen reference in the compute dtype, and for PPO a
value model too. Each rank runs two optimizer steps on one packed micro-batch that fills its token
budget exactly (rows of 512 tokens, `budget x token_shards` tokens per stream); the second step is the
one measured (AdamW state exists, as in every later step).

Measured: the torch CPU allocator's live bytes, from the profiler's allocation/free events
(`profile_memory=True`) recorded from before the models are built, so every tensor the process holds
counts (parameters, optimizer state, gradients, FSDP buffers, activations, temporaries); the peak is
the largest running total inside the second step, per rank, max over ranks; the median of
`--repeats` runs (gloo keeps some collective buffers alive for varying times, a few percent).
Estimated: `rlsp.plan.plan_memory` for the same RoleLayout, budget and options, with the head
split of rlsp.parallel.heads. Relative error = (estimate - measured) / measured; target |error| <=
15 %. `gpu_recorded` compares the estimate with the peaks recorded earlier on an H100
(docs/benchmarks.md, GPU section) for the Qwen2.5-0.5B shape.

Prints ONE JSON line. Usage: python benchmarks/plan_memory.py [--only NAME ...] [--repeats N]
(about 3 minutes per repeat on 2 shared cores)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _launch import layout_dims, run_distributed  # noqa: E402
from torch._C._profiler import _EventType  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402
from transformers import Qwen2Config  # noqa: E402

from rlsp.config.layout import RoleLayout, World  # noqa: E402
from rlsp.data.batch import Batch  # noqa: E402
from rlsp.engine.fsdp_engine import FSDPEngine  # noqa: E402
from rlsp.engine.optim import OptimSettings  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.models.value import ValueModel  # noqa: E402
from rlsp.parallel.heads import plan_head_layout  # noqa: E402
from rlsp.plan import HeadShare, MemoryOptions, Workload, plan_memory, shape_from_config  # noqa: E402
from rlsp.workers.actor_loss import ActorLossConfig, make_actor_loss  # noqa: E402
from rlsp.workers.critic_loss import make_critic_loss  # noqa: E402

CONFIG = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 768, "vocab_size": 4096,
          "tie_word_embeddings": False}
ROW, PROMPT = 512, 128  # tokens per row, of which prompt
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    ulysses: int = 1
    ring: int = 1
    tp: int = 1
    sequence_parallel: bool = True
    fsdp_size: int = -1
    dtype: str = "float32"
    checkpointing: bool = False
    budget: int = 2048
    critic: bool = False
    reference: bool = True  # False: actor only (no KL term needs the reference)
    chunk: int = 1024  # tokens per chunk of the logprob head (actor.logprob_chunk_size)

    def layout(self) -> RoleLayout:
        return RoleLayout(World(1, self.world), ulysses=self.ulysses, ring=self.ring, tp=self.tp,
                          sequence_parallel=self.sequence_parallel, fsdp_size=self.fsdp_size)


CASES = (
    Case("one rank", 1),
    Case("one rank, bf16, checkpointing", 1, dtype="bfloat16", checkpointing=True),
    Case("dp 2 (FSDP over 2)", 2),
    Case("Ulysses 2", 2, ulysses=2),
    Case("ring 2", 2, ring=2, budget=1024),
    Case("tp 2, sequence-parallel", 2, tp=2),
    Case("tp 2, replicated activations, bf16", 2, tp=2, sequence_parallel=False, dtype="bfloat16"),
    Case("Ulysses 2 x dp 2, HSDP fsdp_size 2", 4, ulysses=2, fsdp_size=2),
    Case("Ulysses 2 x tp 2, checkpointing", 4, ulysses=2, tp=2, checkpointing=True),
    Case("dp 2, PPO (actor + ref + critic)", 2, critic=True),
    Case("one rank, actor only (no reference)", 1, reference=False),
    Case("one rank, actor only, logprob chunk 256", 1, reference=False, chunk=256),
)


def _batch(rows: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, CONFIG["vocab_size"], (rows, ROW), generator=g)
    resp = torch.ones(rows, ROW - PROMPT)
    fields = {k: torch.randn(rows, ROW - PROMPT, generator=g) * 0.3 - 3.0 for k in ("old_logprobs", "ref_logprobs")}
    return Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": resp,
                            "advantages": torch.randn(rows, ROW - PROMPT, generator=g), "values": torch.zeros_like(resp),
                            "returns": torch.randn(rows, ROW - PROMPT, generator=g), **fields})


def _engines(case: Case, dims: Any) -> tuple[FSDPEngine, FSDPEngine | None, FSDPEngine | None]:
    """(actor, reference or None, value model or None): the caller holds all three for the whole measurement (a
    reference nobody holds would be freed whenever the garbage collector next runs, mid-step or not)."""
    config = Qwen2Config(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    compute = DTYPES[case.dtype]
    torch.manual_seed(0)
    lm = build_causal_lm_from_config(config, dtype=torch.float32)
    critic = build_causal_lm_from_config(config, dtype=torch.float32).model if case.critic else None
    for model in (lm, critic):
        if model is not None and case.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    frozen = None
    if case.reference:
        ref = build_causal_lm_from_config(config, dtype=compute)
        frozen = FSDPEngine(TokenLogprobModel(ref), dims, torch.device("cpu"), compute_dtype=compute)
    optim = OptimSettings(lr=1e-4, grad_clip=1.0)
    actor = FSDPEngine(TokenLogprobModel(lm, chunk_size=case.chunk), dims, torch.device("cpu"), compute_dtype=compute, optim=optim)
    value = None if critic is None else FSDPEngine(ValueModel(critic), dims, torch.device("cpu"),
                                                   compute_dtype=compute, optim=optim)
    return actor, frozen, value


def _steps(case: Case, dims: Any, actor: FSDPEngine, value: FSDPEngine | None) -> None:
    layout = case.layout()
    rows = case.budget * layout.token_shards // ROW
    batch = _batch(rows * layout.dp_size).chunk(layout.dp_size)[dims.dp_rank]
    tokens = float((ROW - PROMPT) * rows * layout.dp_size)
    for step in range(2):
        with record_function(f"step{step}"):
            actor.train_step(batch, PROMPT, rows, make_actor_loss(ActorLossConfig(), tokens), case.budget,
                             temperature=1.0, with_entropy=True)
            if value is not None:
                value.train_step(batch, PROMPT, rows, make_critic_loss(0.5, tokens), case.budget)


def _walk(nodes: list[Any]) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def _peak_in(prof: Any, label: str) -> tuple[int, int]:
    """(largest live bytes inside the `label` range, live bytes when it starts), from the CPU allocator's
    own running total recorded with every allocation and free while the profiler runs."""
    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    span = next(n for n in nodes if n.name == label)
    events = sorted((n.start_time_ns, n.extra_fields.total_allocated) for n in nodes if n.tag == _EventType.Allocation)
    inside = [total for t, total in events if span.start_time_ns <= t <= span.end_time_ns]
    before = [total for t, total in events if t < span.start_time_ns]
    return max(inside), before[-1] if before else 0


def measure(rank: int, world: int, case: Case) -> dict[str, int]:
    del rank, world
    dims = layout_dims(ulysses=case.ulysses, ring=case.ring, tp=case.tp, fsdp_size=case.fsdp_size,
                       sequence_parallel=case.sequence_parallel)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        actor, frozen, value = _engines(case, dims)
        gc.collect()  # garbage from the build goes now, not at a moment that depends on the parent process
        _steps(case, dims, actor, value)
    dist.barrier()
    del frozen
    peak, at_start = _peak_in(prof, "step1")
    return {"peak": peak, "at_step_start": at_start}


def estimate(case: Case) -> float:
    layout = case.layout()
    shape = shape_from_config(CONFIG)
    heads = plan_head_layout(shape.q_heads // case.tp, shape.kv_heads // case.tp, case.ulysses)
    share = HeadShare(max(heads.q_counts), max(heads.kv_counts))
    opts = MemoryOptions(dtype_bytes=2 if case.dtype == "bfloat16" else 4, checkpointing=case.checkpointing,
                         logprob_chunk=case.chunk)
    return plan_memory(shape, Workload(layout, case.budget, ROW, share), opts, critic=case.critic,
                       ref=case.reference).peak


# Peaks recorded on one H100 by benchmarks/gpu_train_step.py (docs/benchmarks.md, "GPU" section): the
# Qwen2.5-0.5B shape, bf16 over fp32 master weights, actor only (no reference), one rank or one rank of
# 8 (fake group). (label, tokens per rank's stream, sequence length, world, Ulysses, checkpointing, GiB)
GPU_RECORDED = (
    ("step 4k", 4096, 4096, 1, 1, False, 15.7), ("step 16k", 16384, 4096, 1, 1, False, 32.1),
    ("step 32k", 32768, 4096, 1, 1, False, 53.9), ("32k one sequence", 32768, 32768, 1, 1, False, 54.5),
    ("32k one sequence, checkpointing", 32768, 32768, 1, 1, True, 11.9),
    ("longest sp 1 of 8: 512k", 524288, 32768, 8, 1, True, 61.3), ("longest sp 2 of 8: 1M", 1048576, 32768, 8, 2, True, 61.3),
    ("longest sp 4 of 8: 2M", 2097152, 32768, 8, 4, True, 61.8), ("longest sp 8 of 8: 4M", 4194304, 32768, 8, 8, True, 62.3),
)
QWEN05 = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
          "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}


def gpu_recorded() -> list[dict[str, Any]]:
    """The estimate for each recorded GPU peak (no measurement here: the numbers are from the GPU run)."""
    shape, out = shape_from_config(QWEN05), []
    for label, tokens, seq, world, uly, ckpt, gib in GPU_RECORDED:
        heads = plan_head_layout(14, 2, uly)
        w = Workload(RoleLayout(World(1, world), ulysses=uly), tokens // uly, seq,
                     HeadShare(max(heads.q_counts), max(heads.kv_counts)))
        est = plan_memory(shape, w, MemoryOptions(dtype_bytes=2, checkpointing=ckpt), ref=False).peak / 2**30
        out.append({"case": label, "recorded_gib": gib, "estimate_gib": round(est, 2), "rel_error": round((est - gib) / gib, 3)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="case names (substrings) to run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (gloo's buffer lifetimes vary)")
    args = parser.parse_args()
    runs = []
    for case in CASES:
        if args.only and not any(s in case.name for s in args.only):
            continue
        peaks = sorted(max(r["peak"] for r in run_distributed(measure, case.world, case)) for _ in range(args.repeats))
        measured, est = statistics.median(peaks), estimate(case)
        runs.append({"layout": case.name, "world": case.world, "dtype": case.dtype, "checkpointing": case.checkpointing,
                     "budget_tokens_per_rank": case.budget, "measured_mib": round(measured / 2**20, 1),
                     "measured_range_mib": [round(peaks[0] / 2**20, 1), round(peaks[-1] / 2**20, 1)],
                     "estimate_mib": round(est / 2**20, 1), "rel_error": round((est - measured) / measured, 3),
                     "rel_error_vs_max": round((est - peaks[-1]) / peaks[-1], 3)})
    worst = max((abs(r["rel_error"]) for r in runs), default=0.0)
    print(json.dumps({"benchmark": "plan_memory", "device": "cpu", "torch": torch.__version__,
                      "model": "qwen2 h256 8q/4kv d32 I768 L4 V4096 untied", "repeats": args.repeats, "runs": runs,
                      "max_abs_rel_error": worst, "meets_target": worst <= 0.15, "gpu_recorded": gpu_recorded()}))


if __name__ == "__main__":
    main()
