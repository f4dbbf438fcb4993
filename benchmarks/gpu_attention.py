"""Packed causal attention on CUDA without flash-attn: accuracy vs an fp32 reference, time, memory; ONE JSON line.

    python benchmarks/gpu_attention.py --tokens 65536 --seq-len 8192 --impl rlsp
    python benchmarks/gpu_attention.py --tokens 65536 --seq-len 65536 --impl varlen --q-heads 4 --kv-heads 1

A stream of `--tokens` tokens made of sequences of `--seq-len`, `--q-heads` / `--kv-heads` heads of
dim 64 (Qwen2.5-0.5B: 14 / 2; one Ulysses rank's share at sp=2/4/8: 7/1, 4/1, 2/1), bf16. Impls:
  rlsp         rlsp's attention function (`ulysses_attention`, sp=1 context): what the trainer runs
  sdpa_expand  per-sequence SDPA with kv heads expanded to the q heads first
  varlen       torch.nn.attention.varlen.varlen_attn over the whole stream (one kernel)
The reference is exact causal attention per sequence in fp32 (query blocks of 4096 rows, one head
at a time). Reported: max |out - ref| and max |dq - dq_ref| (relative to max |dq_ref|), forward and
forward+backward time (median of 5 after 2 warm-ups), peak memory the call adds over its inputs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.models.attention import ulysses_attention  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context  # noqa: E402

HEAD_DIM = 64


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=0, help="0: one sequence of --tokens")
    p.add_argument("--q-heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--impl", choices=["rlsp", "sdpa_expand", "varlen"], default="rlsp")
    p.add_argument("--no-reference", action="store_true", help="skip the fp32 reference (timing only)")
    p.add_argument("--device", default="cuda")
    return p.parse_args()


def _context(tokens: int, seq_len: int, hq: int, hkv: int) -> tuple[object, list[int]]:
    seq_len = seq_len or tokens
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    ids = torch.ones(len(lens), max(lens), dtype=torch.long)
    mask = (torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]).long()
    return build_sp_context(None, pack_sequences(ids, mask), hq, hkv), lens


class _Module(torch.nn.Module):
    layer_idx = 0


def _impl(name: str, ctx: object, hq: int, hkv: int) -> Callable[..., torch.Tensor]:
    """f(q_THD, k_THD, v_THD) -> o_THD for each implementation."""
    scale = HEAD_DIM**-0.5
    if name == "rlsp":
        module = _Module()

        def rlsp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ctx.cache.clear()
            out, _ = ulysses_attention(module, *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), None,
                                       scaling=scale, sp_context=ctx)
            return out[0]

        return rlsp
    bounds = ctx.cu_seqlens.tolist()
    if name == "sdpa_expand":
        def sdpa_expand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
            outs = []
            for s, e in zip(bounds[:-1], bounds[1:]):
                o = F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
                                                   is_causal=True, scale=scale)
                outs.append(o[0].transpose(0, 1))
            return torch.cat(outs)

        return sdpa_expand
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    cu = ctx.cu_seqlens.to(torch.int32).cuda()
    max_len = ctx.max_seqlen
    kwargs = {"scale": scale}
    kwargs.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
    gqa = "enable_gqa" in params

    def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if gqa:
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, enable_gqa=True, **kwargs)
        k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)

    return varlen


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
               lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention per sequence in fp32 and dq for the output gradient `grad`: fp32 [T, hq, D] each.

    Query blocks of 4096 rows, one head at a time: dS = P * (dO V^T - rowsum(dO * O)), dq = scale * dS K.
    """
    hq, hkv = q.shape[1], k.shape[1]
    scale = HEAD_DIM**-0.5
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dq = torch.empty_like(out)
    start = 0
    for n in lens:
        for h in range(hq):
            qh, go = q[start:start + n, h].float(), grad[start:start + n, h].float()
            kh, vh = (x[start:start + n, h // (hq // hkv)].float() for x in (k, v))
            for r in range(0, n, 4096):
                rows, keys = min(4096, n - r), min(4096, n - r) + r
                pos = torch.arange(keys, device=q.device)
                future = pos[None, :] > pos[r:keys, None]
                p = torch.softmax((qh[r:keys] @ kh[:keys].t() * scale).masked_fill(future, float("-inf")), -1)
                o = p @ vh[:keys]
                ds = p * (go[r:keys] @ vh[:keys].t() - (go[r:keys] * o).sum(-1, keepdim=True))
                out[start + r:start + r + rows, h] = o
                dq[start + r:start + r + rows, h] = (ds @ kh[:keys]) * scale
        start += n
    return out, dq


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], reps: int = 5) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    a = _args()
    ctx, lens = _context(a.tokens, a.seq_len, a.q_heads, a.kv_heads)
    gen = torch.Generator(device=a.device).manual_seed(0)
    q, k, v = (torch.randn(a.tokens, h, HEAD_DIM, device=a.device, dtype=torch.bfloat16, generator=gen)
               for h in (a.q_heads, a.kv_heads, a.kv_heads))
    grad = torch.randn(q.shape, device=a.device, dtype=torch.bfloat16, generator=gen)
    fn = _impl(a.impl, ctx, a.q_heads, a.kv_heads)
    result = {"benchmark": "gpu_attention", "impl": a.impl, "tokens": a.tokens, "seq_len": a.seq_len or a.tokens,
              "q_heads": a.q_heads, "kv_heads": a.kv_heads, "head_dim": HEAD_DIM, "dtype": "bfloat16",
              "device": torch.cuda.get_device_name(0) if a.device == "cuda" else a.device, "torch": torch.__version__}
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

    def fwd_bwd() -> None:
        for x in (qg, kg, vg):
            x.grad = None
        fn(qg, kg, vg).backward(grad)

    try:
        with torch.no_grad():
            fwd_s = _timed(lambda: fn(q, k, v))
        cuda = torch.cuda.is_available()
        _sync()
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        fwd_bwd_s = _timed(fwd_bwd)
        peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    except (torch.OutOfMemoryError, RuntimeError) as e:
        result.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        print(json.dumps(result), flush=True)
        return
    result.update(ok=True, fwd_ms=round(fwd_s * 1e3, 3), fwd_bwd_ms=round(fwd_bwd_s * 1e3, 3),
                  peak_extra_gib=round(peak / 2**30, 3))
    if not a.no_reference:
        ref, dq_ref = _reference(q, k, v, grad, lens)
        with torch.no_grad():
            out = fn(q, k, v).float()
        fwd_bwd()
        result.update(max_abs_err=float((out - ref).abs().max()),
                      ref_max_abs=float(ref.abs().max()),
                      dq_max_rel_err=float((qg.grad.float() - dq_ref).abs().max() / dq_ref.abs().max()))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
