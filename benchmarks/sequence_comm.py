"""Bytes each rank sends per decoder layer, forward and backward, under Ulysses, ring, Ulysses x ring and
tensor parallelism (TP) with and without sequence-parallel activations.

Runs a tiny random-init Qwen2 (4 layers, 8 q / 4 kv heads, head dim 16, hidden 128 = 8 x 16 as in
Llama/Qwen2; the Ulysses and ring bytes do not depend on the hidden size) on CPU over gloo, one
forward + backward of one packed stream of 4 sequences of uneven lengths (488 tokens), at ulysses 2
and 4, ring 2 and 4, ulysses 2 x ring 2 in fp32, ulysses 2 x ring 2 in bf16 (there the ring's fp32
dK/dV accumulators are twice the size of K/V), tp 2 with and without sequence-parallel activations
and ulysses 2 x tp 2 (sequence parallel) in fp32. Groups come from the role layout
(`RoleLayout(World(1, u*r*t), ulysses=u, ring=r, tp=t)`), as in training; TP is applied with
`apply_tensor_parallel` on the tp mesh and no FSDP, so FSDP's parameter all-gathers and gradient
reduce-scatters are not in the numbers (nor is the once-per-step sum of the Partial gradients of
tp-replicated parameters). Ulysses / ring bytes are measured twice: from the SP context counters
(`SPStats`), and independently by wrapping `torch.distributed.all_to_all_single` and
`torch.distributed.batch_isend_irecv` in the workers (and gloo's own all_to_all / send events, see
below, must show the same bytes). TP bytes are measured twice as well: by wrapping
the `torch.ops._c10d_functional` ops that DTensor's redistribution calls (all_gather_into_tensor,
reduce_scatter_tensor, all_reduce; through `torch.distributed._functional_collectives`, on gloo as on
nccl), and at the backend with `torch.profiler` (the gloo:all_gather / gloo:all_reduce events and
their input shapes, which would also show collectives issued from C++). Every number must equal the
closed form exactly (asserted for every rank); the c10d entry points (`dist.all_reduce`,
`all_gather_into_tensor`, `reduce_scatter_tensor`, `all_gather`, `broadcast`) must see nothing.

Closed form per rank and decoder layer (legend: T stream tokens, u ulysses, r ring, t tp, Tr = T / r,
S = Tr / u local tokens, D head dim, h hidden size, e element bytes, Hq / Hkv the query / kv heads
Ulysses splits (all heads / t under TP), hq / hkv this rank's heads inside attention, kv_j the kv heads
Ulysses rank j receives):
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
  TP (t > 1) on the S tokens of the tp group, forward and backward alike (Megatron):
    sequence parallel: 2 all-gathers of the [S/t, h] residual (into the column-parallel q/k/v and
      gate/up; backward: of the gradients of the reduce-scatters) + 2 reduce-scatters of [S, h] (out
      of the row-parallel o_proj / down_proj; backward: of the gradients of the all-gathers);
      inputs 2*(S/t)*h*e + 2*S*h*e;
    without: 2 all-reduces of [S, h] (after o_proj / down_proj; backward: Megatron's f, the
      gradients of the block inputs); inputs 2*S*h*e.
    Off-rank with bandwidth-optimal (ring) algorithms: all-gather (t-1) x its input, reduce-scatter
    (t-1)/t x its input, all-reduce 2(t-1)/t x its input; both variants 4*(t-1)/t*S*h*e.
    Backward with sequence parallel adds 2 all-gathers of the [S/t, h] block inputs: each block saved
    only its shard and re-gathers it for the weight gradients (rlsp.parallel.tp_sp, Megatron's choice;
    through c10d, counted as tp_sp_regather), inputs 2*(S/t)*h*e, off-rank 2*(t-1)/t*S*h*e more.
    gloo has no reduce-scatter of its own: it runs each one as an all-reduce of the whole [t, S/t, h]
    input and keeps its chunk (the profiler shows gloo:all_reduce of that shape), so on gloo the
    sequence-parallel variant moves an all-reduce's bytes per reduce-scatter plus the all-gathers
    (off-rank with ring algorithms 6*(t-1)/t*S*h*e forward, 8*(t-1)/t*S*h*e backward with the
    re-gathers); NCCL reduce-scatters natively.
The counting wrappers and gloo's profiler events: benchmarks/collective_counters.py.
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
from _launch import layout_dims, run_distributed  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import Qwen2Config  # noqa: E402

from benchmarks.collective_counters import (  # noqa: E402
    REGATHER,
    TP_OPS,
    backend_events,
    wrap_collectives,
    wrap_tp_collectives,
)
from rlsp.data.packing import pack_sequences  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.tensor_parallel import apply_tensor_parallel  # noqa: E402
from rlsp.parallel.tp_checks import local_head_counts  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context, shard_for_rank  # noqa: E402

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, ROW_LENS = 4, 8, 4, 16, 128, (97, 130, 61, 200)
CASES = ((2, 1, 1, True, "float32"), (4, 1, 1, True, "float32"), (1, 2, 1, True, "float32"),
         (1, 4, 1, True, "float32"), (2, 2, 1, True, "float32"), (2, 2, 1, True, "bfloat16"),
         (1, 1, 2, True, "float32"), (1, 1, 2, False, "float32"),
         (2, 1, 2, True, "float32"))  # (ulysses, ring, tp, sequence_parallel, dtype)
def _worker(rank: int, world: int, ulysses: int, ring: int, tp: int, seq_par: bool, dtype_name: str) -> dict[str, Any]:
    keys = ("a2a_calls", "a2a_bytes", "a2a_off_rank_bytes", "p2p_calls", "p2p_bytes")
    counter = {p: dict.fromkeys(keys, 0) for p in ("setup", "fwd", "bwd")}
    phase = ["setup"]
    wrap_collectives(counter, phase)
    wrap_tp_collectives(counter, phase)
    dims = layout_dims(ulysses=ulysses, ring=ring, tp=tp, sequence_parallel=seq_par)
    config = Qwen2Config(vocab_size=64, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = TokenLogprobModel(build_causal_lm_from_config(config, dtype=dtype))
    if tp > 1:  # no FSDP: its parameter traffic is not what this benchmark measures
        apply_tensor_parallel(model, dims.tp_mesh, seq_par)
    width = max(ROW_LENS)
    ids_BL = torch.randint(1, 64, (len(ROW_LENS), width), generator=torch.Generator().manual_seed(0))
    mask_BL = (torch.arange(width)[None, :] < torch.tensor(ROW_LENS)[:, None]).long()
    packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=dims.layout.stream_multiple)
    ctx = build_sp_context(dims.ulysses_group, packed, *local_head_counts(config, tp), ring_group=dims.ring_group,
                           ring_dkv_group=dims.ring_dkv_group)
    elem = torch.empty((), dtype=dtype).element_size()
    start = time.perf_counter()
    phase[0] = "fwd"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof_fwd:
        lp_S = model(*(shard_for_rank(x, ctx) for x in (packed.input_ids, packed.position_ids, packed.labels)),
                     ctx)["logprobs"]
    phase[0] = "bwd"  # CPU autograd runs the backward in this thread
    weights = shard_for_rank(packed.label_mask, ctx)
    weights = model.tp_info.local_tokens(weights) if tp > 1 else weights
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof_bwd:
        (lp_S.float() * weights).sum().backward()
    seconds = time.perf_counter() - start
    return {"stats": dataclasses.asdict(ctx.stats), "wrapped": counter, "tokens": packed.total_len,
            "local_tokens": ctx.local_len, "layout": ctx.layout, "ulysses_rank": ctx.ulysses_rank,
            "ring_rank": ctx.ring_rank, "elem": elem, "seconds": seconds,
            "backend": {"fwd": backend_events(prof_fwd), "bwd": backend_events(prof_bwd)}}


def compute_formula(layout: Any, ulysses: int, ring: int, tokens: int, uly_rank: int, elem: int,
                    q_heads: int = Q_HEADS) -> dict[str, int]:
    """Closed-form Ulysses / ring bytes one rank sends per decoder layer (see the module docstring);
    `q_heads` are the query heads Ulysses splits (a tp rank's share under TP)."""
    Tr, D, acc = tokens // ring, HEAD_DIM, 8 if elem == 8 else 4
    S = Tr // ulysses
    hq, hkv = layout.q_count(uly_rank), layout.kv_count(uly_rank)
    out = dict.fromkeys(("a2a_fwd", "a2a_bwd", "a2a_off_rank_fwd", "a2a_off_rank_bwd", "ring_fwd", "ring_bwd"), 0)
    if ulysses > 1:
        own = S * (hq + 2 * hkv) * D * elem + S * hq * D * elem  # the rank's own chunks of both exchanges
        out["a2a_fwd"] = S * D * elem * (q_heads + 2 * sum(layout.kv_counts)) + Tr * hq * D * elem
        out["a2a_bwd"] = Tr * (hq + 2 * hkv) * D * elem + S * q_heads * D * elem
        out["a2a_off_rank_fwd"], out["a2a_off_rank_bwd"] = out["a2a_fwd"] - own, out["a2a_bwd"] - own
    if ring > 1 and hq > 0:
        out["ring_fwd"] = (ring - 1) * 2 * Tr * hkv * D * elem
        out["ring_bwd"] = (ring - 1) * 2 * Tr * hkv * D * (elem + acc)
    return out


def compute_tp_formula(tp: int, seq_par: bool, tokens: int, elem: int) -> dict[str, int]:
    """Closed-form TP bytes one rank hands to each collective per decoder layer and direction (forward
    = backward, plus backward's re-gathers under sequence parallel), off-rank bytes with ring algorithms,
    and what gloo runs (see the module docstring); `tokens` = S, the stream tokens on the tp group."""
    S, h = tokens, HIDDEN
    keys = ("all_gather", "reduce_scatter", "all_reduce", "regather", "off_rank", "gloo_off_rank", "off_rank_bwd",
            "gloo_off_rank_bwd")
    if tp == 1:
        return dict.fromkeys(keys, 0)
    if seq_par and S % tp:
        raise ValueError(f"S={S} tokens are not a multiple of tp={tp}")
    ag, rs, ar = (2 * (S // tp) * h * elem, 2 * S * h * elem, 0) if seq_par else (0, 0, 2 * S * h * elem)
    off_rank = (tp - 1) * ag + (tp - 1) * rs // tp + 2 * (tp - 1) * ar // tp
    gloo_off_rank = (tp - 1) * ag + 2 * (tp - 1) * (rs + ar) // tp  # reduce-scatter run as an all-reduce
    regather = ag  # backward re-gathers each block's saved [S/t, h] input shard (rlsp.parallel.tp_sp)
    return {"all_gather": ag, "reduce_scatter": rs, "all_reduce": ar, "regather": regather, "off_rank": off_rank,
            "gloo_off_rank": gloo_off_rank, "off_rank_bwd": off_rank + (tp - 1) * regather,
            "gloo_off_rank_bwd": gloo_off_rank + (tp - 1) * regather}


def _measured(result: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """(from the SP counters, from the wrapped collectives), bytes per layer."""
    s, w = result["stats"], result["wrapped"]
    counters = {"a2a_fwd": s["a2a_bytes_fwd"], "a2a_bwd": s["a2a_bytes_bwd"],
                "ring_fwd": s["ring_bytes_fwd"], "ring_bwd": s["ring_bytes_bwd"]}
    wrapped = {"a2a_fwd": w["fwd"]["a2a_bytes"], "a2a_bwd": w["bwd"]["a2a_bytes"],
               "a2a_off_rank_fwd": w["fwd"]["a2a_off_rank_bytes"], "a2a_off_rank_bwd": w["bwd"]["a2a_off_rank_bytes"],
               "ring_fwd": w["fwd"]["p2p_bytes"], "ring_bwd": w["bwd"]["p2p_bytes"]}
    return ({k: v / LAYERS for k, v in counters.items()}, {k: v / LAYERS for k, v in wrapped.items()})


def _check_tp(tp: int, seq_par: bool, result: dict[str, Any], where: str) -> dict[str, int]:
    """Wrapped functional collectives and gloo's own events against `compute_tp_formula`, per direction."""
    formula = compute_tp_formula(tp, seq_par, result["local_tokens"], result["elem"])
    calls = {"all_gather": 2 * LAYERS * bool(formula["all_gather"]),
             "reduce_scatter": 2 * LAYERS * bool(formula["reduce_scatter"]),
             "all_reduce": 2 * LAYERS * bool(formula["all_reduce"])}
    for direction in ("fwd", "bwd"):
        w, b = result["wrapped"][direction], result["backend"][direction]
        issued = {k: v for k, v in w.items() if k.startswith(("funcol_", "c10d_"))}
        expected = {}
        for op, key in zip(TP_OPS, ("all_gather", "reduce_scatter", "all_reduce")):
            if calls[key]:
                expected |= {f"funcol_{op}_calls": calls[key], f"funcol_{op}_bytes": formula[key] * LAYERS}
        regathers = calls["all_gather"] if direction == "bwd" else 0
        if regathers:
            expected |= {f"{REGATHER}_calls": regathers, f"{REGATHER}_bytes": formula["regather"] * LAYERS}
        issued |= {k: v for k, v in w.items() if k.startswith(REGATHER)}
        assert issued == expected, f"{where} {direction}: functional/c10d collectives {issued} != formula {expected}"
        gloo = {k: b.get(k, 0) for k in ("all_gather_calls", "all_gather_bytes", "all_reduce_calls", "all_reduce_bytes")}
        expected_gloo = {"all_gather_calls": calls["all_gather"] + regathers,
                         "all_gather_bytes": (formula["all_gather"] + formula["regather"] * bool(regathers)) * LAYERS,
                         "all_reduce_calls": calls["reduce_scatter"] + calls["all_reduce"],
                         "all_reduce_bytes": (formula["reduce_scatter"] + formula["all_reduce"]) * LAYERS}
        assert gloo == expected_gloo, f"{where} {direction}: gloo ran {gloo} != formula {expected_gloo}"
        other = {k: v for k, v in b.items() if not k.startswith(("all_gather_", "all_reduce_", "all_to_all", "send",
                                                                  "recv"))}
        assert not other, f"{where} {direction}: unexpected backend collectives {other}"
    return formula


def _check_rank(ulysses: int, ring: int, tp: int, seq_par: bool, result: dict[str, Any]) -> dict[str, int]:
    formula = compute_formula(result["layout"], ulysses, ring, result["tokens"], result["ulysses_rank"],
                              result["elem"], Q_HEADS // tp)
    counters, wrapped = _measured(result)
    where = f"ulysses={ulysses} ring={ring} tp={tp} rank (u{result['ulysses_rank']}, r{result['ring_rank']})"
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
    assert not any(w["setup"][k] for k in ("a2a_calls", "p2p_calls")), f"{where}: collectives in set-up: {w['setup']}"
    for direction in ("fwd", "bwd"):  # what gloo itself ran: the same all-to-all inputs and sends
        b = result["backend"][direction]
        gloo = {"a2a": b.get("all_to_all_bytes", 0), "ring": b.get("send_bytes", 0)}
        assert gloo == {"a2a": w[direction]["a2a_bytes"], "ring": w[direction]["p2p_bytes"]}, f"{where}: gloo {b}"
    tp_formula = _check_tp(tp, seq_par, result, where)
    return formula | {f"tp_{k}": v for k, v in tp_formula.items()}


def _summarise(ulysses: int, ring: int, tp: int, seq_par: bool, dtype: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    per_rank = [_check_rank(ulysses, ring, tp, seq_par, r) for r in results]
    worst = {k: max(f[k] for f in per_rank) for k in per_rank[0]}
    layout = results[0]["layout"]
    return {
        "ulysses": ulysses, "ring": ring, "tp": tp, "sequence_parallel": seq_par if tp > 1 else None,
        "world": ulysses * ring * tp, "dtype": dtype, "tokens": results[0]["tokens"],
        "tp_group_tokens": results[0]["local_tokens"] if tp > 1 else None,
        "hq_per_rank": layout.q_count(0), "hkv_per_rank": layout.kv_count(0),
        "ranks_identical": all(f == per_rank[0] for f in per_rank),
        # bytes per rank per decoder layer (max over ranks); measured == formula on every rank (asserted)
        "a2a_buffer_fwd": worst["a2a_fwd"], "a2a_buffer_bwd": worst["a2a_bwd"],
        "a2a_off_rank_fwd": worst["a2a_off_rank_fwd"], "a2a_off_rank_bwd": worst["a2a_off_rank_bwd"],
        "ring_fwd": worst["ring_fwd"], "ring_bwd": worst["ring_bwd"],
        # TP inputs per direction (forward = backward); off-rank with ring algorithms, and on gloo
        "tp_all_gather_in": worst["tp_all_gather"], "tp_reduce_scatter_in": worst["tp_reduce_scatter"],
        "tp_all_reduce_in": worst["tp_all_reduce"], "tp_off_rank": worst["tp_off_rank"],
        "tp_gloo_off_rank": worst["tp_gloo_off_rank"],
        # backward under sequence parallel: the same plus the re-gathers of the blocks' saved input shards
        "tp_regather_in_bwd": worst["tp_regather"], "tp_off_rank_bwd": worst["tp_off_rank_bwd"],
        "tp_gloo_off_rank_bwd": worst["tp_gloo_off_rank_bwd"],
        "off_rank_fwd": worst["a2a_off_rank_fwd"] + worst["ring_fwd"] + worst["tp_off_rank"],
        "off_rank_bwd": worst["a2a_off_rank_bwd"] + worst["ring_bwd"] + worst["tp_off_rank_bwd"],
        "a2a_per_layer": 2 * (ulysses > 1), "ring_passes_per_layer_fwd": ring - 1,
        "ring_passes_per_layer_bwd": 2 * (ring - 1),
        "tp_collectives_per_layer": (4 if seq_par else 2) * (tp > 1),
        "tp_collectives_per_layer_bwd": (6 if seq_par else 2) * (tp > 1),
        "measured_equals_formula": True,
        "fwd_bwd_seconds_max_rank": round(max(r["seconds"] for r in results), 3),  # profiler on
    }


def main() -> None:
    runs = [_summarise(u, r, t, sp, dtype, run_distributed(_worker, u * r * t, u, r, t, sp, dtype))
            for u, r, t, sp, dtype in CASES]
    print(json.dumps({"benchmark": "sequence_comm", "device": "cpu", "backend": "gloo", "torch": torch.__version__,
                      "model": f"qwen2 L{LAYERS} h{HIDDEN} {Q_HEADS}q/{KV_HEADS}kv D{HEAD_DIM}",
                      "row_lens": list(ROW_LENS), "unit": "bytes per rank per decoder layer", "runs": runs}))


if __name__ == "__main__":
    main()
