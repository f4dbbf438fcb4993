"""MoE step throughput and memory: expert parallelism 1 / 2 / 4 on gloo ranks, and one MoE layer's expert kernels.

`--device cpu` (default): a qwen3_moe-shaped model (transformers' Qwen3MoeConfig: hidden 256, 8 experts, top-2,
2 layers) goes through rlsp's training engine step (FSDPEngine.backward_batch + AdamW) on `--world` gloo ranks at
every EP degree in `--ep` (EP 1 = plain FSDP2 over the ranks): tokens/s per rank, peak RSS per rank (ru_maxrss),
the bytes of expert parameters + gradients a rank holds (equal at every EP: FSDP2 shards the experts too), the
experts one layer's forward gathers on a rank (E/ep of them), and the first step's loss, whose gap to the first EP
degree's must stay within the fp32 roundoff bound of the forward (tests/tolerances.py; a routing flip exceeds it).

`--device cuda` (or `--device cpu --single`): one process, one Qwen3MoeSparseMoeBlock (router + experts) at the
tiny shape and a Qwen3-30B-A3B-shaped one (hidden 2048, 128 experts, top-8, moe_intermediate 768; bf16 on cuda,
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
import math
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
from torch import nn  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import (  # noqa: E402
    Qwen3MoePreTrainedModel,
    Qwen3MoeSparseMoeBlock,
)

MIB = 2**20
STEP_MODEL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=8,
                  num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, vocab_size=512, norm_topk_prob=True, initializer_range=0.02,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
LAYER_SHAPES = {"tiny": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
                "qwen3_30b_a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                      num_experts_per_tok=8)}
P, R, B = 32, 32, 16  # prompt width, response width, rows of the step's batch
_REPLAY_IMPORT_ERROR: str | None = None  # why rlsp.engine.router_replay cannot be imported here ("" when it can)


def roundoff_bound(reduction: int, stages: int, dtype: torch.dtype, scale: float) -> float:
    """Two evaluations that differ in the order of `stages` chained sums of <= `reduction` terms (tests/tolerances.py
    derivations 1 and 3: 2 * stages * sqrt(n) * u, u of `dtype`) at the value scale `scale`."""
    return 2.0 * stages * math.sqrt(reduction) * torch.finfo(dtype).eps / 2 * scale


# ---- multi-rank engine step --------------------------------------------------------------------------------------

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


# ---- one MoE layer: per-expert loop vs grouped matmul ------------------------------------------------------------

class MoeLayer(nn.Module):
    """One qwen3_moe sparse MoE block; carries the model's output recorder so rlsp's router hooks find its router."""

    _can_record_outputs = Qwen3MoePreTrainedModel._can_record_outputs

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.mlp = Qwen3MoeSparseMoeBlock(config)

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        return self.mlp(x_BTH)


def build_layer(shape: str, device: torch.device, dtype: torch.dtype) -> MoeLayer:
    if shape not in LAYER_SHAPES:
        raise ValueError(f"shape={shape!r}; legal: {sorted(LAYER_SHAPES)}")
    config = Qwen3MoeConfig(**LAYER_SHAPES[shape], norm_topk_prob=True, hidden_act="silu")
    torch.manual_seed(0)
    layer = MoeLayer(config)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.02 if p.dim() < 3 else 1.0 / math.sqrt(p.shape[-1]))
    return layer.to(device=device, dtype=dtype)


def grouped_kernel(layer: MoeLayer, x_NH: torch.Tensor) -> str:
    """What transformers' `grouped_mm` implementation runs on these tensors: torch's grouped matmul when its own
    check (`_can_use_grouped_mm`: device capability, CPU kernel availability) accepts them, else its per-expert
    fallback."""
    from transformers.integrations.moe import _can_use_grouped_mm

    weight = layer.mlp.experts.gate_up_proj
    offs = torch.zeros(weight.shape[0], dtype=torch.int32, device=weight.device)
    if not _can_use_grouped_mm(x_NH, weight, offs):
        return "transformers grouped_mm fallback (per-expert mm)"
    return "torch.nn.functional.grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else "torch._grouped_mm"


def run_path(layer: MoeLayer, impl: str, x_NH: torch.Tensor, g_NH: torch.Tensor, reps: int, replay=None,
             routes=None) -> dict:
    """fwd+bwd of `layer` with experts implementation `impl`: ms (mean of `reps` after one warm-up), peak memory
    (cuda: allocated above what was held before the pass, parameter gradients included; cpu: the process's peak
    RSS), the last output, input gradient and parameter gradients. `replay`: a RouterReplay, recording (routes None) or replaying `routes`."""
    from contextlib import nullcontext

    layer.mlp.experts.config._experts_implementation = impl
    cuda = x_NH.is_cuda
    times = []
    for _ in range(reps + 1):
        layer.zero_grad(set_to_none=True)
        x = x_NH.detach().requires_grad_(True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()  # weights, inputs and earlier results: not this pass's
        ctx = nullcontext() if replay is None else (replay.recording() if routes is None else replay.replaying_local(routes))
        t0 = time.perf_counter()
        with ctx:
            out = layer(x[None])[0]
        out.backward(g_NH)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ms = 1e3 * sum(times[1:]) / reps
    peak = (torch.cuda.max_memory_allocated() - held) / MIB if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"ms": ms, "tokens_per_s": len(x_NH) / ms * 1e3, "peak_mib": peak, "out": out.detach(), "x_grad": x.grad,
            "grads": {n: p.grad.detach().clone() for n, p in layer.named_parameters()}}


def compare_layer(shape: str, tokens: int, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    """The single-process comparison of one shape: a JSON-able line plus (under "tensors") both paths' results."""
    layer = build_layer(shape, device, dtype)
    cfg = layer.mlp.experts.config
    g = torch.Generator(device="cpu").manual_seed(1)
    x_NH = torch.randn(tokens, cfg.hidden_size, generator=g).to(device, dtype)
    g_NH = torch.randn(tokens, cfg.hidden_size, generator=g).to(device, dtype)
    eager = run_path(layer, "eager", x_NH, g_NH, reps)
    grouped = run_path(layer, "grouped_mm", x_NH, g_NH, reps)
    # forward: router (H terms), gate/up (H), down (I), weighted sum (K); the input gradient runs them backward
    reduction = max(cfg.hidden_size, cfg.moe_intermediate_size)
    line = {"bench": "moe_layer", "device": device.type, "dtype": str(dtype).removeprefix("torch."), "shape": shape,
            "tokens": tokens, **LAYER_SHAPES[shape], "grouped_kernel": grouped_kernel(layer, x_NH)}
    for name, res in (("eager", eager), ("grouped_mm", grouped)):
        line.update({f"{name}_{k}": round(res[k], 3) for k in ("ms", "tokens_per_s", "peak_mib")})
    for key, stages in (("out", 4), ("x_grad", 8)):
        diff = float((grouped[key].double() - eager[key].double()).abs().max())
        bound = roundoff_bound(reduction, stages, dtype, float(eager[key].double().abs().max()))
        line.update({f"{key}_max_abs_diff": diff, f"{key}_bound": bound, f"{key}_within": diff <= bound})
    line.update(_replay_cost(layer, x_NH, g_NH, reps, grouped["out"]))
    line["tensors"] = {"eager": eager, "grouped_mm": grouped}
    return line


def _replay_cost(layer: MoeLayer, x_NH: torch.Tensor, g_NH: torch.Tensor, reps: int, free_out: torch.Tensor) -> dict:
    """fwd+bwd ms (grouped_mm) with rlsp's router-replay hooks recording, then replaying the recorded routes, and
    whether the replayed output equals the freely routed one bit for bit."""
    global _REPLAY_IMPORT_ERROR
    if _REPLAY_IMPORT_ERROR is None:  # once: a failed import can leave rlsp half-imported for a second try
        try:
            from rlsp.engine.router_replay import RouterReplay
        except ImportError as exc:  # rlsp.engine pulls in rlsp.config, whose key checks import hydra
            _REPLAY_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
        else:
            _REPLAY_IMPORT_ERROR = ""
    if _REPLAY_IMPORT_ERROR:
        return {"replay_skipped": _REPLAY_IMPORT_ERROR}
    from rlsp.engine.router_replay import RouterReplay
    replay = RouterReplay(layer, "qwen3_moe")
    record = run_path(layer, "grouped_mm", x_NH, g_NH, reps, replay)
    replayed = run_path(layer, "grouped_mm", x_NH, g_NH, reps, replay, replay.recorded_local())
    replay.remove()
    return {"record_ms": round(record["ms"], 3), "replay_ms": round(replayed["ms"], 3),
            "replay_out_equal": bool(torch.equal(replayed["out"], free_out))}


def bench_layers(device: torch.device, tokens: int | None, reps: int) -> bool:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [("tiny", tokens or 256)]
    if device.type == "cuda":
        shapes.append(("qwen3_30b_a3b", tokens or 16384))
    ok = True
    for shape, n in shapes:
        try:
            line = compare_layer(shape, n, device, dtype, reps)
            line.pop("tensors")
            ok &= line["out_within"] and line["x_grad_within"] and line.get("replay_out_equal", True)
        except torch.OutOfMemoryError:
            line = {"bench": "moe_layer", "device": device.type, "shape": shape, "tokens": n, "oom": True}
        except Exception as exc:
            line = {"bench": "moe_layer", "device": device.type, "shape": shape, "tokens": n,
                    "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            ok = False
        if device.type == "cuda":
            torch.cuda.empty_cache()
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
