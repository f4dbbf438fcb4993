"""MoE step throughput and memory: expert parallelism 1 / 2 / 4 on gloo ranks, and one MoE layer's expert kernels.

`--device cpu` (default): a qwen3_moe-shaped model (transformers' Qwen3MoeConfig: hidden 256, 8 experts, top-2,
2 layers) goes through rlsp's training engine step (FSDPEngine.backward_batch + AdamW) on `--world` gloo ranks at
every EP degree in `--ep` (EP 1 = plain FSDP2 over the ranks): tokens/s per rank, peak RSS per rank (ru_maxrss),
the bytes of expert parameters + gradients a rank holds (equal at every EP: FSDP2 shards the experts too), the
experts one layer's forward gathers on a rank (E/ep of them), and the first step's loss, whose gap to the first EP
degree's must stay within the fp32 roundoff bound of the forward (tests/tolerances.py; a routing flip exceeds it).

`--device cuda` (or `--device cpu --single`; benchmarks/moe_layer.py): one process, one Qwen3MoeSparseMoeBlock
(router + experts) at the tiny shape and a Qwen3-30B-A3B-shaped one (hidden 2048, 128 experts, top-8, moe_intermediate 768; bf16 on cuda,
fp32 on cpu; only the tiny one on cpu) over `--tokens` tokens: fwd+bwd ms, tokens/s and peak memory (cuda:
allocated above what was held before the pass; cpu: process peak RSS) of transformers' per-expert loop
(`eager`) and of its grouped matrix multiply (`grouped_mm`: torch.nn.functional.grouped_mm / torch._grouped_mm
where torch has them -- the same inner implementation rlsp's expert parallelism runs on each rank's experts), the
largest output / input-gradient gap between the two against the roundoff bound, and the cost of
rlsp.engine.router_replay's recording and replaying hooks (`replay_skipped` with the reason where rlsp.engine
cannot be imported, e.g. without hydra). An out-of-memory shape prints {"oom": true}.

One JSON line per configuration; exit status 1 when a line failed. Usage:
  python benchmarks/moe_step.py [--device cpu|cuda] [--world 4] [--ep 1 2 4] [--steps 2] [--single] [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402

from benchmarks.moe_layer import MIB, bench_layers, roundoff_bound  # noqa: E402  (the one-layer comparison)

STEP_MODEL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=8,
                  num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, vocab_size=512, norm_topk_prob=True, initializer_range=0.02,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
P, R, B = 32, 32, 16  # prompt width, response width, rows of the step's batch


def _batch(vocab: int):
    from rlsp.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    fields = {k: torch.randn(B, R, generator=g) * 0.3 - 3.0 for k in ("old_logprobs", "ref_logprobs")}
    return Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones(B, P + R, dtype=torch.long),
                            "response_mask": torch.ones(B, R), "advantages": torch.randn(B, R, generator=g), **fields})


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def _engine_step(rank: int, world: int, path: str, ep: int, steps: int) -> dict:
    """One warm-up step (its loss is the one compared), then `steps` timed steps of the policy engine at EP `ep`."""
    from rlsp.config.layout import RoleLayout, World
    from rlsp.engine.fsdp_engine import FSDPEngine
    from rlsp.engine.optim import OptimSettings
    from rlsp.models.lm import TokenLogprobModel
    from rlsp.models.loading import load_causal_lm
    from rlsp.parallel.mesh import build_parallel_dims
    from rlsp.workers.actor_loss import ActorLossConfig, make_actor_loss
    from rlsp.workers.ppo_loop import global_counts

    dims = build_parallel_dims(RoleLayout(World(1, world), ep=ep), "cpu")
    engine = FSDPEngine(TokenLogprobModel(load_causal_lm(path)), dims, torch.device("cpu"),
                        optim=OptimSettings(lr=1e-5, grad_clip=0.0))
    shard = _batch(STEP_MODEL["vocab_size"]).chunk(dims.dp_size)[dims.dp_rank]
    loss_fn = make_actor_loss(ActorLossConfig(), *global_counts(shard, dims.dp_group))
    experts = [p for n, p in engine.module.named_parameters() if ".experts." in n]
    times, loss = [], None
    for step in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        engine.optimizer.zero_grad(set_to_none=True)
        metrics = engine.backward_batch(shard, P, len(shard), loss_fn, temperature=1.0)
        expert_bytes = _local_bytes(experts) + _local_bytes(p.grad for p in experts if p.grad is not None)
        engine.optimizer.step()
        times.append(time.perf_counter() - t0)
        loss = metrics["actor/pg_loss"] if step == 0 else loss
    step_s = sum(times[1:]) / steps
    return {"loss": loss, "step_s": step_s, "tokens_per_s": int(shard["attention_mask"].sum()) / step_s,
            "expert_param_grad_mib": expert_bytes / MIB, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(_engine_step(rank, world, *args), f)
    finally:
        dist.destroy_process_group()


def launch(world: int, *args, timeout_s: float = 300.0) -> list[dict]:
    """Run `_engine_step(rank, world, *args)` on `world` gloo ranks (fork: the parent's imports are reused)."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory(prefix="rlsp_moe_") as tmp:
        ctx = mp.start_processes(_rank_main, args=(world, os.path.join(tmp, "init"), tmp, args), nprocs=world,
                                 join=False, start_method=method)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world={world} args={args} exceeded {timeout_s} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]


def _step_line(config: Qwen3MoeConfig, world: int, path: str, ep: int, steps: int, ref_loss: float | None) -> dict:
    """The JSON line of one EP degree; `ref_loss`: the first degree's loss (None: this is the first)."""
    ranks = launch(world, path, ep, steps)
    ref_loss = ranks[0]["loss"] if ref_loss is None else ref_loss
    tokens = B * (P + R)
    bound = roundoff_bound(max(config.intermediate_size, tokens, config.vocab_size), 4 * config.num_hidden_layers + 1,
                           torch.float32, max(abs(ref_loss), 1.0))
    # what FSDP2 all-gathers for one layer's experts on a rank: the E/ep experts its group holds (fp32)
    gathered = 3 * config.hidden_size * config.moe_intermediate_size * config.num_experts * 4 / ep
    line = {"loss": ranks[0]["loss"], "loss_diff": abs(ranks[0]["loss"] - ref_loss), "loss_bound": bound,
            "experts_gathered_per_layer_mib": gathered / MIB}
    line.update({k: [round(r[k], 3) for r in ranks] for k in
                 ("tokens_per_s", "step_s", "peak_rss_mib", "expert_param_grad_mib")})
    line["within_bound"] = line["loss_diff"] <= bound
    return line


def bench_ranks(world: int, eps: list[int], steps: int) -> bool:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = Qwen3MoeConfig(**STEP_MODEL)
    ok, ref_loss = True, None
    shape = {k: STEP_MODEL[k] for k in ("hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                        "num_hidden_layers")}
    with tempfile.TemporaryDirectory(prefix="rlsp_moe_model_") as path:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        for ep in eps:
            line = {"bench": "moe_step", "device": "cpu", "world": world, "ep": ep, "tokens": B * (P + R),
                    "loss_reference_ep": eps[0], "model": shape}
            try:
                line.update(_step_line(config, world, path, ep, steps, ref_loss))
                ref_loss = line["loss"] if ref_loss is None else ref_loss
                ok &= line["within_bound"]
            except Exception as exc:  # one failed configuration fails the run, the others still print
                line.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
                ok = False
            print(json.dumps(line), flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=2, help="timed engine steps after one warm-up step")
    ap.add_argument("--single", action="store_true", help="the one-layer comparison (always on with --device cuda)")
    ap.add_argument("--tokens", type=int, default=None, help="layer tokens (default 256 tiny, 16384 Qwen3-30B-A3B)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False; use --device cpu [--single]")
    if args.device == "cuda" or args.single:
        return 0 if bench_layers(torch.device(args.device), args.tokens, args.reps) else 1
    bad = [ep for ep in args.ep if args.world % ep or STEP_MODEL["num_experts"] % ep]
    if bad:
        raise SystemExit(f"--ep {bad} must divide --world {args.world} and the {STEP_MODEL['num_experts']} experts")
    return 0 if bench_ranks(args.world, args.ep, args.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
