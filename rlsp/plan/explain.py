"""Words for the planner's choices: why each layout loses to the recommended one, which layouts were
refused or replaced (and by what), and why nothing fits when nothing does.

One short reason per layout: "does not fit: 93.1 GiB > 72.0 GiB" for a layout over the memory of a
GPU; otherwise its estimated time per token relative to the recommended plan and the term that
costs most of the difference (recomputation, uneven heads, bytes inside or between nodes, ...).
"""

from __future__ import annotations

import math

from rlsp.config.layout import RoleLayout
from rlsp.plan.activations import ring_bytes
from rlsp.plan.memory import GIB
from rlsp.plan.search import Plan, Request
from rlsp.plan.workload import HeadShare, Workload
from rlsp.utils.divisors import divisors

MB = 1e6


def layout_name(layout: RoleLayout) -> str:
    """'dp 4 x Ulysses 2' style: only the degrees above 1 (dp always)."""
    parts = [f"dp {layout.dp_size}"]
    if layout.ring > 1:
        parts.append(f"ring {layout.ring}")
    if layout.ulysses > 1:
        parts.append(f"Ulysses {layout.ulysses}")
    if layout.tp > 1:
        parts.append(f"tp {layout.tp}" + ("" if layout.sequence_parallel else " (no SP)"))
    return " x ".join(parts)


def fsdp_name(layout: RoleLayout) -> str:
    if layout.fsdp_size == -1:
        return f"all {layout.fsdp_ranks}"
    return "none" if layout.fsdp_size == 1 else f"HSDP {layout.fsdp_size}"


def _compute_cause(plan: Plan, best: Plan) -> str:
    if plan.settings.checkpointing and not best.settings.checkpointing:
        return "recomputes every layer in backward (activation checkpointing)"
    if plan.settings.tiled_mlp_shards and not best.settings.tiled_mlp_shards:
        return "recomputes the MLP in backward (tiled MLP)"
    if plan.imbalance > best.imbalance + 1e-9:
        q = sorted(set(plan.split.q_counts), reverse=True)
        return f"uneven heads ({' or '.join(map(str, q))} q heads per Ulysses rank: {plan.imbalance:.2f}x attention)"
    if plan.layout.tp > 1 and not plan.layout.sequence_parallel:
        return "every tp rank runs the output head on all its tokens (no sequence-parallel activations)"
    return "more compute per token"


def _bytes_cause(plan: Plan, best: Plan, which: str, layers: int) -> str:
    mine, theirs = getattr(plan.comm, which), getattr(best.comm, which)
    where = "inter-node" if which == "inter" else "intra-node"
    if theirs <= 0:
        return f"{mine / layers / MB:,.0f} MB {where} per layer and micro-batch (recommended: none)"
    return f"{mine / plan.tokens / (theirs / best.tokens):.1f}x the {where} bytes per token of the recommended plan"


def loss_reason(plan: Plan, best: Plan, req: Request) -> str:
    """One short reason why `plan` is not the recommended `best`."""
    if not plan.fits and plan.memory.peak <= req.cluster.usable:
        return f"host memory does not fit: {plan.host / GIB:.1f} GiB > {req.cluster.host_usable / GIB:.1f} GiB per node"
    if not plan.fits:
        return f"does not fit: {plan.memory.peak / GIB:.1f} GiB > {req.cluster.usable / GIB:.1f} GiB"
    diffs = {key: getattr(plan, f"{key}_s") / plan.tokens - getattr(best, f"{key}_s") / best.tokens
             for key in ("compute", "intra", "inter", "host")}
    cause = max(diffs, key=lambda k: diffs[k])
    ratio = best.throughput / plan.throughput
    if diffs[cause] <= 0 or ratio < 1.005:
        return f"{ratio:.2f}x the time per token (a tie on the estimate)"
    if cause in ("intra", "inter"):
        text = _bytes_cause(plan, best, cause, req.shape.layers)
    elif cause == "host" and plan.settings.param_offload and not best.settings.param_offload:
        text = "copies parameter shards in and gradient shards out over PCIe (parameter offload)"
    elif cause == "host":
        text = "copies saved activations to host memory and back (activation offload)"
    else:
        text = _compute_cause(plan, best)
    return f"{ratio:.2f}x the time per token: {text}"


def refusals(req: Request, plans: list[Plan]) -> list[str]:
    """Layouts refused or replaced, each with what the planner does instead."""
    shape, per_node = req.shape, req.cluster.gpus_per_node
    legal = shape.legal_tp()
    lines = []
    for tp in (t for t in divisors(per_node) if t > 1):
        if tp not in legal and shape.tp_refusal():
            lines.append(f"tp {tp}: rlsp's tensor parallelism refuses {shape.tp_refusal()}")
        elif tp not in legal:
            lines.append(f"tp {tp}: does not divide {shape.q_heads} q heads / {shape.kv_heads} kv heads / MLP width "
                         f"{shape.intermediate} evenly (legal tp for this model: {', '.join(map(str, legal))})")
    big = [t for t in legal if t > per_node]
    if big:
        lines.append(f"tp {big[0]}: more ranks than the {per_node} GPUs of a node (tp groups stay inside a node)")
    tps = sorted({1, plans[0].layout.tp}) if plans else [1]
    for tp in tps:
        lines += _sequence_lines(req, [p for p in plans if p.layout.tp == tp], tp)
    return lines


def _sequence_lines(req: Request, plans: list[Plan], tp: int) -> list[str]:
    """For each sequence split k = ulysses x ring where Ulysses alone cannot or should not do it: the
    decomposition chosen and why."""
    per_node, heads = req.cluster.gpus_per_node // tp, req.shape.q_heads // tp
    by_k: dict[int, list[Plan]] = {}
    for p in plans:
        by_k.setdefault(p.layout.sp_size, []).append(p)
    lines = []
    tp_text = f" of a tp {tp} rank" if tp > 1 else ""
    for k in sorted(by_k):
        crosses, uneven = k > per_node, heads % k != 0
        if k == 1 or not (crosses or uneven):
            continue
        chosen = by_k[k][0]  # plans are sorted: fastest fitting first
        lay = chosen.layout
        pick = " x ".join(f"{name} {n}" for name, n in (("Ulysses", lay.ulysses), ("ring", lay.ring)) if n > 1)
        uneven_text = f"Ulysses {k} splits them unevenly ({heads // k + 1} or {heads // k} per rank)"
        if crosses:
            times_tp = f" x tp {tp}" if tp > 1 else ""
            why = (f"Ulysses {k}{times_tp} would span {-(-k // per_node)} nodes of {req.cluster.gpus_per_node} GPUs "
                   "(Ulysses x tp stays inside a node; ring may cross nodes)")
        elif lay.ring == 1:
            why = f"uneven ({heads // k + 1} or {heads // k} q heads per rank) but the fastest split over {k} ranks"
        else:
            why = f"{uneven_text}, slower here"
        fit = "" if chosen.fits else f" (does not fit either{_ring_text(req, chosen)})"
        lines.append(f"{heads} q heads over {k} ranks{tp_text}: {pick}{fit}; {why}")
    return lines


def _ring_text(req: Request, plan: Plan) -> str:
    """What ring attention's block math costs on this plan, when it is what breaks the memory."""
    share = HeadShare(max(plan.split.q_counts), max(plan.split.kv_counts))
    ring = ring_bytes(Workload(plan.layout, plan.settings.budget, req.seq_len, share), req.shape.head_dim,
                      req.dtype_bytes)
    if ring < 0.25 * plan.memory.peak:
        return ""
    return (f": ring attention's accumulators and fused-kernel buffers over a rank's share of the stream, "
            f"{ring / GIB:,.0f} GiB")


def settings_name(plan: Plan) -> str:
    s = plan.settings
    parts = [f"checkpointing {'on' if s.checkpointing else 'off'}"]
    parts += ["activation offload"] * s.activation_offload + [f"tiled MLP ({s.tiled_mlp_shards} tiles)"] * bool(s.tiled_mlp_shards)
    parts += ["parameter offload (state in host memory)"] * s.param_offload + ["lean RMSNorms"] * s.lean_norm
    return ", ".join(parts)


def infeasible(req: Request, plans: list[Plan]) -> str:
    """Why no layout fits: the closest one, what its memory is made of, and what would change that."""
    low = min(plans, key=lambda p: p.memory.peak)
    if low.memory.peak <= req.cluster.usable:  # the device would hold it: the host memory is what is short
        host = min(plans, key=lambda p: p.host if p.memory.peak <= req.cluster.usable else float("inf"))
        return (f"no layout fits: those that fit the GPUs need host memory for offloaded state and activations, at "
                f"least {host.host / GIB:.1f} GiB per node ({layout_name(host.layout)}, {settings_name(host)}) > "
                f"{req.cluster.host_usable / GIB:.1f} GiB usable of --host-memory-gib={req.cluster.host_memory_gib:g}")
    state = sum(v for k, v in low.memory.terms.items() if k.endswith(("state", "gradients")))
    usable, world = req.cluster.usable, req.cluster.world.world_size
    text = (f"no layout fits {req.cluster.gpu_memory_gib:g} GiB GPUs ({usable / GIB:.1f} GiB usable): the smallest "
            f"estimate is {low.memory.peak / GIB:.1f} GiB per GPU ({layout_name(low.layout)}, FSDP "
            f"{fsdp_name(low.layout)}, {settings_name(low)}, {low.settings.budget} tokens per GPU): model state "
            f"(weights, gradients, optimizer) {state / GIB:.1f} GiB, activations and buffers "
            f"{(low.memory.peak - state) / GIB:.1f} GiB (peak at the {low.memory.phase})")
    if state > usable:
        return text + (f"; the model state alone exceeds a GPU: it shards over the GPUs, so at least "
                       f"{math.ceil(state * world / usable)} GPUs of this size are needed")
    return text + "; more GPUs (longer Ulysses or ring degrees), shorter sequences or larger GPUs are needed"
