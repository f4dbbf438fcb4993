"""Bytes each rank sends per decoder layer, forward and backward, under Ulysses, ring and Ulysses x ring.

Runs a tiny random-init Qwen2 (4 layers, 8 q / 4 kv heads, head dim 16, hidden 64) on CPU over gloo,
one forward + backward of one packed stream of 4 sequences of uneven lengths (488 tokens), at
ulysses 2 and 4, ring 2 and 4, and ulysses 2 x ring 2 in fp32, plus ulysses 2 x ring 2 in bf16
(there the ring's fp32 dK/dV accumulators are twice the size of K/V). Groups come from the role
layout (`RoleLayout(World(1, u*r), ulysses=u, ring=r)`), as in training. Bytes are measured twice:
from the SP context counters (`SPStats`), and independently by wrapping
`torch.distributed.all_to_all_single` and `torch.distributed.batch_isend_irecv` in the workers.
Both must equal the closed form exactly (asserted for every rank).

Closed form per rank and decoder layer (legend: T stream tokens, u ulysses, r ring, Tr = T / r,
S = Tr / u local tokens, D head dim, e element bytes of q/k/v, Hq / Hkv all query / kv heads,
hq / hkv this rank's heads inside attention, kv_j the kv heads Ulysses rank j receives):
  Ulysses (u > 1), all_to_all_single send buffers, own chunk included (what the counters record):
    forward:  S*D*e*(Hq + 2*sum_j kv_j)  [fused q/k/v in]  +  Tr*hq*D*e  [out]
    backward: Tr*(hq + 2*hkv)*D*e        [dq/dk/dv]        +  S*Hq*D*e  [d out]
    even layout without kv replication (sum_j kv_j = Hkv): both are S*D*e*2*(Hq + Hkv), i.e. this
    rank's q, k, v and out for all heads; the own chunk, 1/u of it, stays on the rank, so
    (u-1)/u of it leaves the rank ("off-rank" below, also measured from the split sizes).
  Ring (r > 1), point-to-point sends to ring rank i+1 (all off-rank):
    forward:  (r-1) * 2*Tr*hkv*D*e                  (K and V)
    backward: (r-1) * 2*Tr*hkv*D*(e + 4)            (K and V again, plus the fp32 dK/dV accumulators)
  Ulysses x ring: both, with hkv = Hkv / u after the Ulysses exchange.
Prints ONE JSON line. Usage: python benchmarks/sequence_comm.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _launch import layout_dims, run_distributed  # noqa: E402
from transformers import Qwen2Config  # noqa: E402

from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context, shard_for_rank  # noqa: E402

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, ROW_LENS = 4, 8, 4, 16, (97, 130, 61, 200)
CASES = ((2, 1, "float32"), (4, 1, "float32"), (1, 2, "float32"), (1, 4, "float32"), (2, 2, "float32"),
         (2, 2, "bfloat16"))  # (ulysses, ring, dtype)


def _wrap_collectives(counter: dict[str, dict[str, int]], phase: list[str]) -> None:
    """Count what this process hands to all_to_all_single / batch_isend_irecv, per phase."""
    a2a, p2p = dist.all_to_all_single, dist.batch_isend_irecv

    def counted_a2a(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                    input_split_sizes: Any = None, group: Any = None, **kwargs: Any) -> Any:
        c = counter[phase[0]]
        row = input[0].numel() * input.element_size() if input.dim() else input.element_size()
        own = input_split_sizes[dist.get_rank(group)] if input_split_sizes else input.shape[0] // dist.get_world_size(group)
        c["a2a_calls"] += 1
        c["a2a_bytes"] += input.numel() * input.element_size()
        c["a2a_off_rank_bytes"] += input.numel() * input.element_size() - own * row
        return a2a(output, input, output_split_sizes, input_split_sizes, group, **kwargs)

    def counted_p2p(ops: list[dist.P2POp]) -> Any:
        c = counter[phase[0]]
        c["p2p_calls"] += 1
        c["p2p_bytes"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return p2p(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = counted_a2a, counted_p2p  # this worker process only


def _worker(rank: int, world: int, ulysses: int, ring: int, dtype_name: str) -> dict[str, Any]:
    keys = ("a2a_calls", "a2a_bytes", "a2a_off_rank_bytes", "p2p_calls", "p2p_bytes")
    counter = {p: dict.fromkeys(keys, 0) for p in ("setup", "fwd", "bwd")}
    phase = ["setup"]
    _wrap_collectives(counter, phase)
    dims = layout_dims(ulysses=ulysses, ring=ring)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    torch.manual_seed(0)
    model = TokenLogprobModel(build_causal_lm_from_config(config, dtype=getattr(torch, dtype_name)))
    width = max(ROW_LENS)
    ids_BL = torch.randint(1, 64, (len(ROW_LENS), width))
    mask_BL = (torch.arange(width)[None, :] < torch.tensor(ROW_LENS)[:, None]).long()
    packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=dims.layout.stream_multiple)
    ctx = build_sp_context(dims.ulysses_group, packed, Q_HEADS, KV_HEADS, ring_group=dims.ring_group)
    start = time.perf_counter()
    phase[0] = "fwd"
    lp_S = model(*(shard_for_rank(x, ctx) for x in (packed.input_ids, packed.position_ids, packed.labels)), ctx)["logprobs"]
    phase[0] = "bwd"  # CPU autograd runs the backward in this thread
    (lp_S.float() * shard_for_rank(packed.label_mask, ctx)).sum().backward()
    return {"stats": dataclasses.asdict(ctx.stats), "wrapped": counter, "tokens": packed.total_len,
            "layout": ctx.layout, "ulysses_rank": ctx.ulysses_rank, "ring_rank": ctx.ring_rank,
            "elem": torch.empty((), dtype=getattr(torch, dtype_name)).element_size(),
            "seconds": time.perf_counter() - start}


def compute_formula(layout: Any, ulysses: int, ring: int, tokens: int, uly_rank: int, elem: int) -> dict[str, int]:
    """Closed-form bytes one rank sends per decoder layer (see the module docstring)."""
    Tr, D, acc = tokens // ring, HEAD_DIM, 8 if elem == 8 else 4
    S = Tr // ulysses
    hq, hkv = layout.q_count(uly_rank), layout.kv_count(uly_rank)
    out = dict.fromkeys(("a2a_fwd", "a2a_bwd", "a2a_off_rank_fwd", "a2a_off_rank_bwd", "ring_fwd", "ring_bwd"), 0)
    if ulysses > 1:
        own = S * (hq + 2 * hkv) * D * elem + S * hq * D * elem  # the rank's own chunks of both exchanges
        out["a2a_fwd"] = S * D * elem * (Q_HEADS + 2 * sum(layout.kv_counts)) + Tr * hq * D * elem
        out["a2a_bwd"] = Tr * (hq + 2 * hkv) * D * elem + S * Q_HEADS * D * elem
        out["a2a_off_rank_fwd"], out["a2a_off_rank_bwd"] = out["a2a_fwd"] - own, out["a2a_bwd"] - own
    if ring > 1 and hq > 0:
        out["ring_fwd"] = (ring - 1) * 2 * Tr * hkv * D * elem
        out["ring_bwd"] = (ring - 1) * 2 * Tr * hkv * D * (elem + acc)
    return out


def _measured(result: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """(from the SP counters, from the wrapped collectives), bytes per layer."""
    s, w = result["stats"], result["wrapped"]
    counters = {"a2a_fwd": s["a2a_bytes_fwd"], "a2a_bwd": s["a2a_bytes_bwd"],
                "ring_fwd": s["ring_bytes_fwd"], "ring_bwd": s["ring_bytes_bwd"]}
    wrapped = {"a2a_fwd": w["fwd"]["a2a_bytes"], "a2a_bwd": w["bwd"]["a2a_bytes"],
               "a2a_off_rank_fwd": w["fwd"]["a2a_off_rank_bytes"], "a2a_off_rank_bwd": w["bwd"]["a2a_off_rank_bytes"],
               "ring_fwd": w["fwd"]["p2p_bytes"], "ring_bwd": w["bwd"]["p2p_bytes"]}
    return ({k: v / LAYERS for k, v in counters.items()}, {k: v / LAYERS for k, v in wrapped.items()})


def _check_rank(ulysses: int, ring: int, result: dict[str, Any]) -> dict[str, int]:
    formula = compute_formula(result["layout"], ulysses, ring, result["tokens"], result["ulysses_rank"], result["elem"])
    counters, wrapped = _measured(result)
    where = f"ulysses={ulysses} ring={ring} rank (u{result['ulysses_rank']}, r{result['ring_rank']})"
    for key, value in [*counters.items(), *wrapped.items()]:
        assert value == formula[key], f"{where}: {key} measured {value} != formula {formula[key]}"
    s, w = result["stats"], result["wrapped"]
    calls = {"a2a_fwd": s["a2a_calls_fwd"], "a2a_bwd": s["a2a_calls_bwd"], "ring_fwd": s["ring_calls_fwd"],
             "ring_bwd": s["ring_calls_bwd"]}
    assert calls == {"a2a_fwd": w["fwd"]["a2a_calls"], "a2a_bwd": w["bwd"]["a2a_calls"],
                     "ring_fwd": w["fwd"]["p2p_calls"] // max(ring - 1, 1),
                     "ring_bwd": w["bwd"]["p2p_calls"] // max(2 * (ring - 1), 1)}, f"{where}: calls {calls} vs {w}"
    assert calls == {"a2a_fwd": 2 * LAYERS * (ulysses > 1), "a2a_bwd": 2 * LAYERS * (ulysses > 1),
                     "ring_fwd": LAYERS * (ring > 1), "ring_bwd": LAYERS * (ring > 1)}, f"{where}: calls {calls}"
    assert not any(w["setup"].values()), f"{where}: collectives outside the forward/backward: {w['setup']}"
    return formula


def _summarise(ulysses: int, ring: int, dtype: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    per_rank = [_check_rank(ulysses, ring, r) for r in results]
    worst = {k: max(f[k] for f in per_rank) for k in per_rank[0]}
    layout = results[0]["layout"]
    return {
        "ulysses": ulysses, "ring": ring, "world": ulysses * ring, "dtype": dtype, "tokens": results[0]["tokens"],
        "hq_per_rank": layout.q_count(0), "hkv_per_rank": layout.kv_count(0),
        "ranks_identical": all(f == per_rank[0] for f in per_rank),
        # bytes per rank per decoder layer (max over ranks); measured == formula on every rank (asserted)
        "a2a_buffer_fwd": worst["a2a_fwd"], "a2a_buffer_bwd": worst["a2a_bwd"],
        "a2a_off_rank_fwd": worst["a2a_off_rank_fwd"], "a2a_off_rank_bwd": worst["a2a_off_rank_bwd"],
        "ring_fwd": worst["ring_fwd"], "ring_bwd": worst["ring_bwd"],
        "off_rank_fwd": worst["a2a_off_rank_fwd"] + worst["ring_fwd"],
        "off_rank_bwd": worst["a2a_off_rank_bwd"] + worst["ring_bwd"],
        "a2a_per_layer": 2 * (ulysses > 1), "ring_passes_per_layer_fwd": ring - 1,
        "ring_passes_per_layer_bwd": 2 * (ring - 1),
        "measured_equals_formula": True,
        "fwd_bwd_seconds_max_rank": round(max(r["seconds"] for r in results), 3),
    }


def main() -> None:
    runs = [_summarise(u, r, dtype, run_distributed(_worker, u * r, u, r, dtype)) for u, r, dtype in CASES]
    print(json.dumps({"benchmark": "sequence_comm", "device": "cpu", "backend": "gloo", "torch": torch.__version__,
                      "model": f"qwen2 L{LAYERS} {Q_HEADS}q/{KV_HEADS}kv D{HEAD_DIM}", "row_lens": list(ROW_LENS),
                      "unit": "bytes per rank per decoder layer", "runs": runs}))


if __name__ == "__main__":
    main()
