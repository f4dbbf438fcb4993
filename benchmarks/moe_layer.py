"""One MoE layer's expert kernels, for benchmarks/moe_step.py (`--device cuda`, or `--device cpu --single`): a
Qwen3MoeSparseMoeBlock (router + experts) run through transformers' per-expert loop (`eager`) and its grouped matrix
multiply (`grouped_mm`), compared every element against the roundoff bound, with the cost of rlsp.engine.router_replay's
recording and replaying hooks. The script's docstring says what each JSON line holds.

Imported by the script (not a script itself).
"""

from __future__ import annotations

import json
import math
import resource
import time
import traceback

import torch
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoePreTrainedModel,
    Qwen3MoeSparseMoeBlock,
)

MIB = 2**20
LAYER_SHAPES = {"tiny": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
                "qwen3_30b_a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                      num_experts_per_tok=8)}
_REPLAY_IMPORT_ERROR: str | None = None  # why rlsp.engine.router_replay cannot be imported here ("" when it can)


def roundoff_bound(reduction: int, stages: int, dtype: torch.dtype, scale: float) -> float:
    """Two evaluations that differ in the order of `stages` chained sums of <= `reduction` terms (tests/tolerances.py
    derivations 1 and 3: 2 * stages * sqrt(n) * u, u of `dtype`) at the value scale `scale`."""
    return 2.0 * stages * math.sqrt(reduction) * torch.finfo(dtype).eps / 2 * scale


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
