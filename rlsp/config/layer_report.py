"""Per layer kind of a model, what runs where at a run's Ulysses / ring / tensor-parallel degrees (what
`python -m rlsp.check` prints under "layers").

One line per distinct decoder-layer kind (rlsp.config.layer_kinds: attention kind, window, soft-cap, sinks,
heads and head dims, multi-latent ranks, linear-attention heads, dense or MoE MLP) with its count and layer
indices: how Ulysses splits its heads (the caller passes rlsp.parallel.heads.plan_head_layout, the uneven plan the
runtime uses, which this layer-0 module cannot import; linear attention: key-head groups, the same plan over groups,
rlsp/models/linear_attention.py), what tp and ring do to it, which attention kernel
runs it on cpu and on cuda (rlsp/models/attention.py, window_attention.py, linear_attention.py), and its MLP.
The checks that refuse a layout (rlsp.models.loading, rlsp.parallel.tensor_parallel) are not repeated here.

Reads the config dict only (a config.json, or a transformers config's to_dict()): no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlsp.config.layer_kinds import LINEAR, Attention, LayerKind, Mlp, layer_kinds

# (q heads, kv heads, ulysses) -> a head layout with q_counts, kv_counts, idle_ranks and extra_kv_heads()
HeadPlan = Callable[[int, int, int], Any]


def _counts(counts: tuple[int, ...]) -> str:
    return "+".join(str(c) for c in counts)


def _indices(layers: list[int]) -> str:
    shown = ", ".join(str(i) for i in layers[:6])
    return f"layer {shown}" if len(layers) == 1 else f"layers {shown}" + (", ..." if len(layers) > 6 else "")


def _heads(a: Attention) -> str:
    if a.mla:
        q_rank, kv_rank, rope = a.latent
        ranks = (f"q_lora {q_rank}, " if q_rank else "") + f"kv_lora {kv_rank}"
        return (f"multi-latent, {a.q_heads} q / {a.kv_heads} kv heads after the latent expansion, q/k dim "
                f"{a.qk_dim} ({a.qk_dim - rope} nope + {rope} rope), v dim {a.v_dim}, {ranks}")
    extras = [f"window {a.window}"] if a.window is not None else []
    extras += [f"soft-cap {a.softcap:g}"] if a.softcap else []
    extras += ["attention sinks"] if a.sinks else []
    extras += ["output-gated q"] if a.gated_q else []
    return ", ".join([*extras, f"{a.q_heads} q / {a.kv_heads} kv heads of dim {a.qk_dim}"])


def _ulysses(q: int, kv: int, ulysses: int, tp: int, plan_head_layout: HeadPlan) -> str:
    """How tp, then Ulysses, split a softmax layer's heads."""
    if tp > 1:
        if q % tp or kv % tp:
            return f"tp {tp} does not divide {q} q / {kv} kv heads"
        q, kv = q // tp, kv // tp
    where = f"tp {tp}: {q} q / {kv} kv heads per tp rank; " if tp > 1 else ""
    if ulysses == 1:
        return where + "Ulysses 1: every head on each rank"
    plan = plan_head_layout(q, kv, ulysses)
    kv_text = f"kv {_counts(plan.kv_counts)}" + (" (replicated)" if plan.extra_kv_heads() else "")
    idle = f", {len(plan.idle_ranks)} rank(s) idle" if plan.idle_ranks else ""
    return where + f"Ulysses {ulysses} splits q {_counts(plan.q_counts)}, {kv_text}{idle}"


def _kernel(a: Attention, ring: int) -> str:
    """Which attention kernel runs the layer (rlsp/models/attention.py's dispatch)."""
    if a.sinks:
        return "torch banded kernel with sinks on cpu and cuda (flash_attn has no sinks)"
    if a.window is not None or a.softcap:
        what = "window" if a.softcap is None else "softcap" if a.window is None else "window + softcap"
        return f"torch banded kernel on cpu / flash_attn {what} on cuda"
    if a.mla and ring > 1:
        return (f"ring attention over {ring} ranks, each holding 1/{ring} of the stream (k dim {a.qk_dim} and v dim "
                f"{a.v_dim} side by side in each K/V block; fused kernels with the narrower side zero-padded per tile)")
    if a.mla:
        return f"SDPA on cpu / flash_attn on cuda (v zero-padded to {a.qk_dim}, output sliced back)"
    if ring > 1:
        return f"ring attention over {ring} ranks, each holding 1/{ring} of the stream"
    return "SDPA on cpu / flash_attn varlen on cuda"


def _linear(a: Attention, ulysses: int, tp: int, plan_head_layout: HeadPlan) -> str:
    """How tp (key-head groups per tp rank: rlsp.parallel.tp_linear_attention), then Ulysses, split a Gated DeltaNet."""
    kh, vh, kd, vd, conv = a.linear
    if tp > 1 and kh % tp:
        return f"Gated DeltaNet, {kh} key / {vh} value heads: tp {tp} does not divide its {kh} key-head groups"
    groups = kh // tp
    plan = plan_head_layout(groups, groups, ulysses)
    idle = f", {len(plan.idle_ranks)} rank(s) idle" if plan.idle_ranks else ""
    split = f"split {_counts(plan.q_counts)}{idle}" if ulysses > 1 else "all on each rank (Ulysses 1)"
    where = f", tp {tp}: {groups} per tp rank," if tp > 1 else ""
    return (f"Gated DeltaNet, {kh} key / {vh} value heads (key dim {kd}, value dim {vd}); {kh} key-head groups"
            f"{where} {split}; conv {conv}, state {kd}x{vd} per value head, no KV cache; transformers' torch chunked "
            "rule per packed row on cpu / flash-linear-attention chunk_gated_delta_rule on cuda (when installed)")


def _mlp(m: Mlp) -> str:
    if not m.moe:
        return f"dense MLP {m.width}"
    shared = f" + shared {m.shared}" if m.shared else ""
    return f"MoE {m.experts} experts of {m.width}, {m.active} per token{shared}"


def _line(kind: LayerKind, layers: list[int], degrees: tuple[int, int, int], plan: HeadPlan) -> str:
    a, (ulysses, ring, tp) = kind.attention, degrees
    head = f"{a.kind} x {len(layers)} ({_indices(layers)})"
    if a.kind == LINEAR:
        return f"{head}: {_linear(a, ulysses, tp, plan)}; {_mlp(kind.mlp)}"
    split = _ulysses(a.q_heads, a.kv_heads, ulysses, tp, plan)
    return f"{head}: {_heads(a)}; {split}; {_kernel(a, ring)}; {_mlp(kind.mlp)}"


def layer_section(cfg: dict[str, Any], role: Any, plan_head_layout: HeadPlan) -> tuple[str, ...]:
    """rlsp.check's "layers" section at a role's degrees (a RoleLayout): its title, then its lines; a layer kind
    without a shape model gives one line saying so (the support checks refuse such models by name)."""
    title = f"layers (actor: ulysses {role.ulysses}, ring {role.ring}, tp {role.tp})"
    try:
        return title, *describe_layers(cfg, plan_head_layout, role.ulysses, role.ring, role.tp)
    except (ValueError, KeyError) as exc:
        return title, f"not described: {exc}"


def describe_layers(cfg: dict[str, Any], plan_head_layout: HeadPlan, ulysses: int = 1, ring: int = 1,
                    tp: int = 1) -> list[str]:
    """One line per distinct layer kind of the config dict, in order of first appearance (`plan_head_layout`:
    rlsp.parallel.heads.plan_head_layout); ValueError (from rlsp.config.layer_kinds) for layer kinds without a
    shape model."""
    groups: dict[tuple[Attention, Mlp], list[int]] = {}
    for i, kind in enumerate(layer_kinds(cfg)):
        groups.setdefault((kind.attention, kind.mlp), []).append(i)
    kinds = {(k.attention, k.mlp): k for k in layer_kinds(cfg)}
    return [_line(kinds[key], layers, (ulysses, ring, tp), plan_head_layout) for key, layers in groups.items()]
