"""Communication of a training layout: bytes each rank sends per micro-batch, inside and between nodes.

Closed forms per decoder layer and micro-batch (forward + backward; e = compute dtype bytes, S the
rank's sequence shard, Tr its ring share, D head dim, hq / hkv the rank's heads after the Ulysses
split, q_j / kv_j those of Ulysses rank j, all heads counted per tp rank), as measured exactly by
benchmarks/sequence_comm.py (docs/benchmarks.md, "Sequence-parallel communication"):
  Ulysses  off-rank all-to-all bytes: forward S*D*e*(sum_j (q_j + 2 kv_j) - (hq + 2 hkv)) for q/k/v in
           plus S*(u-1)*hq*D*e for the output; backward the inverse exchanges,
           S*(u-1)*(hq + 2 hkv)*D*e + S*(Hq - hq)*D*e
  ring     forward (r-1)*2*Tr*hkv*D*e (K and V), backward (r-1)*2*Tr*hkv*D*(e+4) (plus fp32 dK/dV)
  TP       sequence-parallel: 2 all-gathers + 2 reduce-scatters of [S, h] forward and backward;
           replicated: 2 all-reduces each way; either way 8*(tp-1)/tp*S*h*e (ring algorithm)
  FSDP     all-gather of the layer's shard forward and again backward (compute dtype) and a
           reduce-scatter of its fp32 gradient: (n-1)/n * P_layer/tp * (2e + 4) over the n-rank shard
           group; HSDP adds an all-reduce of the sharded gradient over the replicas, 2*(R-1)/R * P/(tp n)*4
Activation checkpointing repeats the forward exchanges (Ulysses, ring, TP) when it recomputes a layer.
Per micro-batch, outside the layers: FSDP gathers the root unit (embedding, lm_head, final norm) once
and reduces its gradient; with sequence-parallel TP the replicated parameters' gradients are partial
sums, all-reduced over tp (fp32).
A collective counts as inter-node when its group spans nodes (ring groups and FSDP groups may; Ulysses
and tp groups never do, validation keeps them inside a node).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from rlsp.config.layout import RoleLayout
from rlsp.config.model_shape import ModelShape
from rlsp.plan.memory import tp_replicated
from rlsp.plan.workload import Workload


@dataclass(frozen=True)
class HeadSplit:
    """Heads of every Ulysses rank inside attention (q_counts[j], kv_counts[j]), per tp rank."""

    q_counts: tuple[int, ...]
    kv_counts: tuple[int, ...]


@dataclass
class Comm:
    """Bytes one rank sends per micro-batch: per layer by collective, and totals inside / between nodes."""

    per_layer: dict[str, float] = field(default_factory=dict)
    per_micro_batch: dict[str, float] = field(default_factory=dict)
    intra: float = 0.0
    inter: float = 0.0


def ulysses_layer_bytes(w: Workload, split: HeadSplit, head_dim: int, e: int, checkpointing: bool) -> float:
    """Off-rank all-to-all bytes of the busiest Ulysses rank for one layer (forward twice when recomputed)."""
    u = w.layout.ulysses
    if u == 1:
        return 0.0
    sent_all = sum(q + 2 * kv for q, kv in zip(split.q_counts, split.kv_counts))
    total_q = sum(split.q_counts)
    worst = 0.0
    for q, kv in zip(split.q_counts, split.kv_counts):
        fwd = (sent_all - (q + 2 * kv)) + (u - 1) * q
        bwd = (u - 1) * (q + 2 * kv) + (total_q - q)
        worst = max(worst, (fwd * (2 if checkpointing else 1) + bwd) * w.shard * head_dim * e)
    return worst


def ring_layer_bytes(w: Workload, head_dim: int, e: int, checkpointing: bool) -> float:
    r = w.layout.ring
    if r == 1:
        return 0.0
    kv = 2 * w.heads_len * w.heads.kv * head_dim
    return (r - 1) * (kv * e * (2 if checkpointing else 1) + kv * (e + 4))


def tp_layer_bytes(w: Workload, hidden: int, e: int, checkpointing: bool) -> float:
    tp = w.layout.tp
    if tp == 1:
        return 0.0
    one_way = 4 * (tp - 1) / tp * w.shard * hidden * e  # 2 all-gathers + 2 reduce-scatters of [S/tp, h] blocks
    regather = one_way / 2  # backward all-gathers each block's saved input shard again (rlsp.parallel.tp_sp)
    return one_way * (2 if checkpointing else 1) + one_way + regather


def _fsdp_bytes(params: float, layout: RoleLayout, e: int, gathers: int) -> tuple[float, float]:
    """(shard-group bytes, replica all-reduce bytes) for `params` parameters of a tp rank, gathered
    `gathers` times per micro-batch."""
    n, replicas = layout.fsdp_shard, layout.fsdp_ranks // layout.fsdp_shard
    shard = (n - 1) / n * params * (gathers * e + 4)
    replicate = 2 * (replicas - 1) / replicas * params / n * 4
    return shard, replicate


def _spans_nodes(ranks: list[int], per_node: int) -> bool:
    return len({r // per_node for r in ranks}) > 1


@functools.cache  # a function of the (frozen, hashable) layout alone; the search evaluates each layout many times
def group_locality(layout: RoleLayout) -> dict[str, bool]:
    """Whether any group of each kind spans nodes: ring, fsdp (shard group), replicate (HSDP), tp_root."""
    per_node, world = layout.world.procs_per_node, layout.world_size
    rings: dict[tuple[int, int, int], list[int]] = {}
    for rank in range(world):
        c = layout.coords(rank)
        rings.setdefault((c.dp, c.ulysses, c.tp), []).append(rank)
    shard_groups: dict[tuple[int, int], list[int]] = {}
    replica_groups: dict[tuple[int, int], list[int]] = {}
    for rank in range(world):
        j, tp_rank = divmod(rank, layout.tp)  # non-tp index, as the (replicate, shard, tp) mesh orders it
        shard_groups.setdefault((j // layout.fsdp_shard, tp_rank), []).append(rank)
        replica_groups.setdefault((j % layout.fsdp_shard, tp_rank), []).append(rank)
    return {"ring": any(_spans_nodes(g, per_node) for g in rings.values()),
            "fsdp": any(_spans_nodes(g, per_node) for g in shard_groups.values()),
            "replicate": any(_spans_nodes(g, per_node) for g in replica_groups.values())}


def plan_comm(shape: ModelShape, w: Workload, split: HeadSplit, e: int, checkpointing: bool) -> Comm:
    """Bytes per rank per micro-batch of one training role on layout `w.layout`."""
    lay, d = w.layout, shape.head_dim
    whole = sum(tp_replicated(shape, k, lay) for k in shape.kinds)  # MoE blocks under tp: not split
    layer = ((shape.decoder_params - whole) / lay.tp + whole) / shape.layers  # a layer on average
    fsdp, replicate = _fsdp_bytes(layer, lay, e, gathers=2)
    per_layer = {"ulysses": ulysses_layer_bytes(w, split, d, e, checkpointing),
                 "ring": ring_layer_bytes(w, d, e, checkpointing),
                 "tp": tp_layer_bytes(w, shape.hidden, e, checkpointing), "fsdp": fsdp, "hsdp": replicate}
    root_fsdp, root_replicate = _fsdp_bytes(shape.root_params, lay, e, gathers=1)  # replicated over tp
    root_tp = 2 * (lay.tp - 1) / lay.tp * shape.root_params * 4 if lay.tp_shards_tokens else 0.0
    per_micro = {"fsdp_root": root_fsdp, "hsdp_root": root_replicate, "tp_root_grads": root_tp}
    where = group_locality(lay)
    crosses = {"ulysses": False, "tp": False, "ring": where["ring"], "fsdp": where["fsdp"], "hsdp": where["replicate"]}
    comm = Comm(per_layer, per_micro)
    for key, value in per_layer.items():
        total = value * shape.layers + per_micro.get(f"{key}_root", 0.0)
        if crosses[key]:
            comm.inter += total
        else:
            comm.intra += total
    comm.intra += root_tp
    return comm
