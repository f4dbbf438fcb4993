"""Enumerate the training layouts of a cluster, estimate each one's memory and speed, rank them.

A candidate is a RoleLayout (dp x ring x Ulysses x tp, sequence-parallel activations or not, FSDP
shard group) plus settings that change memory but not the layout (activation checkpointing, tiled
MLP and its tile count, activation offload, FSDP parameter offload, memory-lean RMSNorms with
checkpointing, the token budget per GPU). Only layouts validation accepts are generated:
tp divides the model's heads and MLP width, Ulysses x tp divides the GPUs of a node, ulysses x ring
x tp divides the world. For each layout the settings that fit and run fastest are kept.

Speed is a rough per-micro-batch time on one rank: matmul and attention FLOPs at a sustained rate
(ring attention's fused tiles at RING_ATTENTION_SLOWDOWN times the cost of one flash kernel),
plus the bytes of `plan_comm` over the node's and the network's bandwidth (not overlapped), plus the
host copies of activation offload and of parameter offload (rlsp/plan/offload.py) over PCIe. A plan
fits when its device peak fits a GPU and its host bytes (offloaded state and activations) the node's
host memory. It ranks layouts; it does not predict step times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rlsp.config.layout import RoleLayout, World
from rlsp.config.model_shape import ModelShape
from rlsp.plan.comm import Comm, HeadSplit, plan_comm
from rlsp.plan.memory import GIB, HeadShare, MemoryEstimate, MemoryOptions, Workload, plan_memory, tp_replicated
from rlsp.plan.offload import host_bytes_per_node, offload_copy_bytes
from rlsp.utils.divisors import divisors

# (q heads, kv heads, ulysses) -> heads of every Ulysses rank; rlsp.parallel.heads.plan_head_layout
# computes it (the CLI passes an adapter: that module sits above this layer).
SplitFn = Callable[[int, int, int], HeadSplit]
BUDGET_GRANULE = 64  # token budgets are multiples of this (streams stay multiples of stream_multiple)
# Ring attention runs each tile through the memory-efficient kernel with kv expanded and fp32 accumulators
# (rlsp/parallel/ring_block.py), charged at this multiple of a flash kernel's time for the same work. Measured:
# one ring step of 32k keys, bf16, 8 q / 2 kv heads on an H200 (causal work of 32k tokens) takes 39.1 ms
# (benchmarks/ring_block.py), cuDNN's flash kernel ~8.9 ms for it (64k causal, 14 q heads: 62.2 ms on an
# H100, scaled by 1/4 and 8/14; benchmarks/gpu_attention.py): 4.4x, 3.9x for the visiting step.
RING_ATTENTION_SLOWDOWN = 4.0
TILED_MLP_SHARDS = (4, 16, 64)  # tile counts tried; a tile keeps at least MIN_TILE_TOKENS (smaller tiles starve the GPU)
MIN_TILE_TOKENS = 4096


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    headroom: float = 0.10  # kept free for the CUDA context, NCCL buffers, allocator fragmentation
    host_memory_gib: float = 1024.0  # per node; holds offloaded state and activations (same headroom kept)

    @property
    def world(self) -> World:
        return World(self.nodes, self.gpus_per_node)

    @property
    def usable(self) -> float:
        return self.gpu_memory_gib * GIB * (1.0 - self.headroom)

    @property
    def host_usable(self) -> float:
        return self.host_memory_gib * GIB * (1.0 - self.headroom)


@dataclass(frozen=True)
class Speeds:
    tflops: float = 300.0  # sustained dense FLOP/s per GPU, in TFLOP/s
    intra_gbps: float = 300.0  # GB/s a GPU sends inside its node
    inter_gbps: float = 40.0  # GB/s a GPU sends to other nodes
    host_gbps: float = 25.0  # GB/s between GPU and host over PCIe (activation and parameter offload)


@dataclass(frozen=True)
class Request:
    shape: ModelShape
    cluster: Cluster
    seq_len: int  # longest sequence: prompt + response tokens
    critic: bool = False  # PPO: a value model on the actor's layout, colocated
    dtype_bytes: int = 2
    max_budget: int = 32768  # grow a budget up to this many tokens per GPU when sequences are shorter
    logprob_chunk: int = 1024
    speeds: Speeds = field(default_factory=Speeds)
    tiled_mlp: bool = False  # whether the schema has the tiled-MLP keys (the option is enumerated)
    activation_offload: bool = False
    reference: bool = True  # a frozen reference model is placed (KL loss or KL in the reward)
    param_offload: bool = True  # whether FSDP parameter offload is enumerated
    lean_norm: bool = False  # whether the schema has model.lean_rmsnorm (enumerated with checkpointing)
    flash: bool = True  # flash_attn installed: windowed / soft-capped layers run it (else rlsp's torch banded kernel)
    image_tokens: int = 0  # image tokens per sequence (vision-language data); the tower's activations scale with them


@dataclass(frozen=True)
class Settings:
    checkpointing: bool
    budget: int
    tiled_mlp_shards: int = 0
    activation_offload: bool = False
    param_offload: bool = False
    lean_norm: bool = False


@dataclass
class Plan:
    layout: RoleLayout
    settings: Settings
    memory: MemoryEstimate
    comm: Comm
    split: HeadSplit
    fits: bool
    compute_s: float
    intra_s: float
    inter_s: float
    host_s: float
    tokens: float  # distinct tokens per GPU per micro-batch
    host: float = 0.0  # host bytes per node (offloaded state and activations)
    reason: str = ""

    @property
    def seconds(self) -> float:
        return self.compute_s + self.intra_s + self.inter_s + self.host_s

    @property
    def throughput(self) -> float:
        """Estimated tokens per second per GPU (ranking only)."""
        return self.tokens / self.seconds

    @property
    def imbalance(self) -> float:
        """Attention work of the busiest Ulysses rank over the mean (uneven head splits)."""
        q = self.split.q_counts
        return max(q) * len(q) / sum(q)


def fsdp_sizes(world: World, tp: int) -> list[int]:
    """FSDP shard groups worth trying: all non-tp ranks (-1), one node's (HSDP across nodes), 1 (replicated)."""
    ranks, per_node = world.world_size // tp, world.procs_per_node // tp
    sizes = [-1]
    if 1 < per_node < ranks:
        sizes.append(per_node)
    if ranks > 1:
        sizes.append(1)
    return sizes


def candidate_layouts(shape: ModelShape, world: World) -> Iterator[RoleLayout]:
    """Every layout validation accepts for this model on `world` (see the module docstring)."""
    per_node = world.procs_per_node
    for tp in (t for t in shape.legal_tp() if per_node % t == 0):
        for uly in divisors(per_node // tp):
            for ring in divisors(world.world_size // (uly * tp)):
                for sp in (True, False) if tp > 1 else (True,):
                    for size in fsdp_sizes(world, tp):
                        yield RoleLayout(world, ulysses=uly, ring=ring, tp=tp, sequence_parallel=sp, fsdp_size=size)


def budgets(req: Request, layout: RoleLayout) -> list[int]:
    """Token budgets per GPU: the smallest whose stream holds one whole sequence, doubled up to max_budget."""
    shards = layout.token_shards
    low = math.ceil(math.ceil(req.seq_len / shards) / BUDGET_GRANULE) * BUDGET_GRANULE
    out = [low]
    while out[-1] * 2 <= req.max_budget:
        out.append(out[-1] * 2)
    return out


def tile_counts(req: Request, layout: RoleLayout, budget: int) -> tuple[int, ...]:
    """Tiled-MLP tile counts tried (0: off): the first of TILED_MLP_SHARDS always, more tiles only while a
    tile keeps MIN_TILE_TOKENS of the rank's sequence shard. Not with tp (validation refuses it)."""
    if not req.tiled_mlp or layout.tp > 1:
        return (0,)
    shard = budget * layout.token_shards // layout.sp_size
    more = tuple(n for n in TILED_MLP_SHARDS[1:] if shard // n >= MIN_TILE_TOKENS)
    return (0, TILED_MLP_SHARDS[0], *more)


def settings_for(req: Request, layout: RoleLayout) -> Iterator[Settings]:
    params = (False, True) if req.param_offload else (False,)
    for budget in budgets(req, layout):
        for shards in tile_counts(req, layout, budget):
            for param in params:
                yield Settings(False, budget, shards, param_offload=param)
                for lean in (False, True) if req.lean_norm else (False,):  # lean norms where memory is tight
                    yield Settings(True, budget, shards, param_offload=param, lean_norm=lean)
                    if req.activation_offload:
                        yield Settings(True, budget, shards, activation_offload=True, param_offload=param, lean_norm=lean)


def _flops(req: Request, w: Workload, s: Settings) -> float:
    """Matmul and attention FLOPs of one rank for one micro-batch (forward, backward, recomputation)."""
    shape, lay = req.shape, w.layout
    # MoE: the active experts; under tp every rank runs a MoE block's active experts on all its shard's tokens
    whole = sum(tp_replicated(shape, k, lay, active=True) for k in shape.kinds)
    active = (shape.active_decoder_params - whole) / lay.tp + whole
    matmul = 2 * w.shard * (active / shape.layers - 2 * shape.hidden / lay.tp)
    span = min(req.seq_len, w.stream)  # causal pairs of the stream: T * span / 2, 4 D flops per pair and head
    attention = 2 * w.heads.q * shape.head_dim * w.stream * span / lay.ring
    if lay.ring > 1:
        attention *= RING_ATTENTION_SLOWDOWN
    layer_fwd = matmul + attention
    head_fwd = 2 * w.kept * shape.vocab * shape.hidden
    total = shape.layers * layer_fwd * (4 if s.checkpointing else 3) + head_fwd * 4
    if s.tiled_mlp_shards:
        total += shape.layers * 2 * w.shard * 3 * shape.hidden * shape.intermediate
    return total


def evaluate(req: Request, layout: RoleLayout, s: Settings, split: HeadSplit) -> Plan:
    share = HeadShare(max(split.q_counts), max(split.kv_counts))
    w = Workload(layout, s.budget, req.seq_len, share, image_tokens=req.image_tokens)
    opts = MemoryOptions(req.dtype_bytes, s.checkpointing, s.tiled_mlp_shards, s.activation_offload, req.logprob_chunk,
                         param_offload=s.param_offload, lean_norm=s.lean_norm, flash=req.flash)
    memory = plan_memory(req.shape, w, opts, critic=req.critic, ref=req.reference)
    host = host_bytes_per_node(req.shape, w, opts, req.critic, req.reference)
    comm = plan_comm(req.shape, w, split, req.dtype_bytes, s.checkpointing)
    sp, roles = req.speeds, ("actor", "critic") if req.critic else ("actor",)
    offloaded = req.shape.layers * w.kept * req.shape.hidden * req.dtype_bytes if s.activation_offload else 0.0
    copies = len(roles) * 2 * offloaded  # activations out in forward, back in backward
    if s.param_offload:
        copies += sum(offload_copy_bytes(req.shape, layout, role) for role in roles)
    fits = memory.peak <= req.cluster.usable and host <= req.cluster.host_usable
    n = len(roles)
    return Plan(layout, s, memory, comm, split, fits, compute_s=n * _flops(req, w, s) / (sp.tflops * 1e12),
                intra_s=n * comm.intra / (sp.intra_gbps * 1e9), inter_s=n * comm.inter / (sp.inter_gbps * 1e9),
                host_s=copies / (sp.host_gbps * 1e9), tokens=w.stream / layout.ranks_per_dp, host=host)


def _best(plans: list[Plan]) -> Plan:
    """The fastest plan that fits, else the one needing the least memory."""
    fitting = [p for p in plans if p.fits]
    if fitting:
        # on a tie, fewer memory options: tiled MLP and lean norms are chosen where they let a plan fit or run faster
        return max(fitting, key=lambda p: (p.throughput, -p.settings.tiled_mlp_shards, -p.settings.lean_norm, -p.memory.peak))
    return min(plans, key=lambda p: p.memory.peak)


def search(req: Request, split_fn: SplitFn) -> list[Plan]:
    """One plan per set of degrees (dp, ring, Ulysses, tp, sequence-parallel activations) with its best FSDP
    shard group and settings; the fastest fitting first, then the others by memory."""
    splits: dict[tuple[int, int], HeadSplit] = {}
    groups: dict[tuple[int, int, int, bool], list[Plan]] = {}
    for layout in candidate_layouts(req.shape, req.cluster.world):
        key = (layout.tp, layout.ulysses)
        if key not in splits:
            splits[key] = split_fn(req.shape.q_heads // layout.tp, req.shape.kv_heads // layout.tp, layout.ulysses)
        degrees = (layout.ring, layout.ulysses, layout.tp, layout.sequence_parallel)
        groups.setdefault(degrees, []).extend(evaluate(req, layout, s, splits[key]) for s in settings_for(req, layout))
    best = [_best(plans) for plans in groups.values()]  # one per set of degrees: its best FSDP group and settings
    return sorted(best, key=lambda p: (not p.fits, -p.throughput if p.fits else p.memory.peak))
