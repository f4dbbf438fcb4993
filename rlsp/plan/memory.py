"""Memory per rank of a training layout: model state sharded per the layout, activations, buffers.

Every number is bytes on ONE rank, for one micro-batch stream of `budget x token_shards` tokens
(the budget is `*_max_token_len_per_gpu`). Terms (e = compute dtype bytes):
  state      trainable role: fp32 master 4 + fp32 gradient 4 + AdamW 8 bytes per parameter; frozen
             reference: e per parameter. Layer weights are split over tp and then over the FSDP shard
             group; the embedding, lm_head and final norm are replicated over tp (rlsp's TP plan) and
             sharded over the FSDP group. Parameters count every layer by its kind (MoE: every expert); with
             expert parallelism (ep) the routed experts are split over ep ranks and sharded over the ranks
             holding the same ones (every FSDP rank holds 1/fsdp_ranks of them), and a layer's all-gather
             brings only its 1/ep of them.
  saved      what autograd keeps for backward (per layer, by its kind: rlsp.config.auto_memory; measured op
             by op on rlsp's forward of the Llama / Qwen2 layer): two RMSNorms (fp32 upcast of the input, the normalised output and the
             projection input: h*(4+e)+4 per token each; with model.lean_rmsnorm only the input and the
             fp32 1/rms, h*e+4; plus h*e per token of the [S] tensor the column-parallel projections read), attention (q, k, v and output for the rank's heads
             over its ring share of the stream, fp32 log-sum-exp, the o_proj input) and the gated MLP
             (four [tokens, I/tp] tensors). Activation checkpointing keeps one [tokens, h] input per
             layer instead, and recomputes one layer at a time in backward.
  buffers    FSDP2 all-gathers one layer (and prefetches the next) in the compute dtype; a layer's
             unsharded gradients (plus their fp32 copy for the reduce); the root unit (embedding,
             lm_head, final norm) stays unsharded from forward to the end of backward, with the
             lm_head gradient next to it.
  head       the vocab-chunked logprob head's backward (rlsp/models/logprobs.py), one [chunk, vocab]
             block at a time: one fp32 buffer (the logit gradient formed in place), two when the
             entropy is in the loss (entropy_coeff != 0), plus a compute-dtype copy below fp32.
  working    one layer's backward: the MLP's intermediate gradients, the Ulysses exchange buffers,
             tp's re-gathered inputs, ring attention's fused tiles (fp32 accumulators, the K/V blocks
             in flight, one tile's kernel buffers: O(tokens x heads x D), see `ring_bytes`).
  offload    FSDP parameter offload (param_offload, CPUOffloadPolicy): every role's state and the
             gradients between updates live in host memory (rlsp/plan/offload.py counts them per node),
             the optimizer step runs on the CPU; the device keeps the layers in flight and the root unit
             (as above) and, per layer, fp32 shard copies: two layers' shards copied in before their
             all-gather and one reduced gradient shard before it is copied out ("offload staging").
  reference  none when neither KL term needs it (`ref=False`: use_kl_loss=false, use_kl_in_reward=false).
The peak is the largest of: the start of backward (saved activations and the head), a layer's
backward (saved activations or the gradients reduced so far, one recomputed layer with
checkpointing, the working set), the end of backward (the root's gradients reduced) and the
optimizer step (AdamW's temporaries). Other roles on the rank (reference, colocated critic) add
their resident state. Checked against measured peaks of real engine steps by
benchmarks/plan_memory.py (docs/benchmarks.md, "Planner memory model").

Legend: T stream tokens, S = T / (ulysses x ring) tokens of a sequence shard, s tokens a rank keeps
outside the projections (S / tp with sequence-parallel activations, else S), Tr = T / ring tokens
inside attention, hq / hkv the rank's heads inside attention, D head dim, I intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlsp.config.auto_memory import RankSpan, attention_saved_bytes, block_bytes, mlp_saved_bytes, mlp_width
from rlsp.config.layer_kinds import LayerKind
from rlsp.config.layout import RoleLayout
from rlsp.config.model_shape import ModelShape
from rlsp.config.vision_shape import tower_saved_bytes
from rlsp.parallel.ring_heads import acc_bytes, kv_heads_per_pass

GIB = 2**30
ROLES = ("actor", "ref", "critic")


@dataclass(frozen=True)
class MemoryOptions:
    """Settings that change memory but not the parallel layout."""

    dtype_bytes: int = 2  # compute dtype: 2 for bfloat16, 4 for float32
    checkpointing: bool = False
    tiled_mlp_shards: int = 0  # 0: off; n: the MLP runs over n token tiles (recomputed in backward)
    activation_offload: bool = False  # checkpointed layer inputs kept in host memory (needs checkpointing)
    logprob_chunk: int = 1024  # actor_rollout_ref.actor.logprob_chunk_size
    param_offload: bool = False  # FSDP2 CPUOffloadPolicy: every role's shards, gradients, AdamW state in host memory
    entropy_grad: bool = False  # actor.entropy_coeff != 0: the head's backward forms the entropy's gradient too
    lean_norm: bool = False  # model.lean_rmsnorm: a norm keeps its input and fp32 1/rms per token (rlsp/models/rms_norm.py)
    flash: bool = True  # flash_attn runs windowed / soft-capped layers (CUDA); False: rlsp's torch banded kernel


@dataclass(frozen=True)
class HeadShare:
    """Heads the busiest rank holds inside attention (after the tp and Ulysses splits)."""

    q: int
    kv: int


@dataclass(frozen=True)
class Workload:
    """One role's layout and the micro-batch it runs: `budget` tokens per rank, sequences of up to
    `seq_len` tokens, `heads` the busiest rank's share inside attention."""

    layout: RoleLayout
    budget: int
    seq_len: int
    heads: HeadShare
    image_tokens: int = 0  # image tokens per sequence (its prompt's images); 0: text-only data

    @property
    def rank_image_tokens(self) -> int:
        """Image tokens whose patches this rank encodes: its share of the stream's images (rlsp.models.vision_lm
        spreads them over the ranks of a stream by patches)."""
        return -(-self.shard * min(self.image_tokens, self.seq_len) // self.seq_len)

    @property
    def stream(self) -> int:
        """T: tokens of one packed stream (the budget times the pieces the layout cuts it into)."""
        return self.budget * self.layout.token_shards

    @property
    def shard(self) -> int:
        """S: tokens of a sequence shard (outside attention, before tp's sequence split)."""
        return self.stream // self.layout.sp_size

    @property
    def kept(self) -> int:
        """s: tokens a rank keeps in the residual stream (S / tp with sequence-parallel activations)."""
        return self.shard // self.layout.tp if self.layout.tp_shards_tokens else self.shard

    @property
    def heads_len(self) -> int:
        """Tr: tokens a rank sees inside attention (its ring share of the stream)."""
        return self.stream // self.layout.ring

    def span(self, flash: bool = True) -> RankSpan:
        """This rank's share of a layer, as rlsp.config.auto_memory's per-kind terms take it."""
        u, ring, tp = self.layout.ulysses, self.layout.ring, self.layout.tp  # ring alone: o_proj reads attention's output
        return RankSpan(self.heads_len, self.shard, self.heads.q, self.heads.kv, u, tp, self.seq_len, flash, u > 1 or ring == 1)


@dataclass
class MemoryEstimate:
    """Peak bytes per rank and the named terms it is made of (bytes)."""

    peak: float
    phase: str  # which moment sets the peak: "backward start", "backward end" or "optimizer step"
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB


def state_bytes(shape: ModelShape, layout: RoleLayout, role: str, e: int) -> tuple[float, float]:
    """(state without gradients, gradients) of one role on one rank."""
    root = shape.critic_root_params if role == "critic" else shape.root_params
    routed = sum(_routed(shape, k) for k in shape.kinds) if layout.ep > 1 else 0
    params = ((shape.decoder_params - routed) / layout.tp + root) / layout.fsdp_shard + routed / layout.fsdp_ranks
    if role == "ref":
        return params * e, 0.0
    return params * 12.0, params * 4.0  # fp32 master + AdamW moments; fp32 gradients


def _routed(shape: ModelShape, kind: LayerKind) -> int:
    """A layer's routed-expert parameters (gated: gate, up and down per expert)."""
    return kind.mlp.experts * 3 * shape.hidden * kind.mlp.width


def offload_staging_bytes(shape: ModelShape, layout: RoleLayout) -> float:
    """Param offload's device copies of fp32 shards: the two layers in flight copied in before their
    all-gather, and one layer's reduced gradient shard before it is copied out."""
    return 3 * shape.layer_params / layout.tp / layout.fsdp_shard * 4


def layer_saved_bytes(shape: ModelShape, w: Workload, opts: MemoryOptions, kind: LayerKind | None = None) -> float:
    """Bytes one decoder layer (`kind`; None: the first) saves for backward without checkpointing."""
    e, h, kind = opts.dtype_bytes, shape.hidden, kind or shape.layer_list()[0]
    # per block: the norm's own tensors (HF's: the fp32 upcast, the normed value and 1/rms; the lean norm:
    # its input and 1/rms), and the normed input the projections save (under tp with sequence-parallel
    # activations only this rank's [s, h] shard, re-gathered in backward)
    norm = h * e + 4 if opts.lean_norm else h * (4 + e) + 4
    norms = 2 * (w.kept * norm + w.kept * h * e)
    span = w.span(opts.flash)
    mlp = 0 if opts.tiled_mlp_shards else mlp_saved_bytes(kind, h, span, e)
    return norms + attention_saved_bytes(kind, shape.q_heads, span, e) + mlp


def decoder_saved_bytes(shape: ModelShape, w: Workload, opts: MemoryOptions) -> float:
    """Bytes all decoder layers save for backward without checkpointing (each by its kind)."""
    return sum(layer_saved_bytes(shape, w, opts, kind) for kind in shape.layer_list())


RING_TILE_TOKENS = 16384  # rows and keys of a ring-attention tile at most (rlsp/parallel/ring_tiles.py MAX_TILE)


def ring_bytes(w: Workload, head_dim: int, dtype_bytes: int) -> float:
    """Ring attention's working set in a layer's backward with its fused kernels (rlsp/parallel/ring.py,
    ring_block.py): no rows x keys scores, only O(tokens x heads x D) buffers, for ONE head group: the
    backward runs over groups of n kv heads and their q heads, one after another, n by the runtime's
    rule (`kv_heads_per_pass`: the largest divisor of hkv whose fp32 accumulators fit RING_BWD_ACC_BYTES,
    rlsp/parallel/ring_heads.py), so per group: fp32 accumulators dq [Tr, hq_g] and three dK/dV
    [2, Tr, n] (this rank's, the visiting block's, its receive buffer); the held and the next K/V block
    [2, Tr, n] in the element size; one tile's kernel buffers on CUDA, where k/v are expanded to the q
    heads: expanded k/v and dq/dk/dv over up to a sequence's share `box`, at most RING_TILE_TOKENS
    (5 x box x hq_g, element size) plus the kernel's fp32 dq workspace (box x hq_g); plus the per-box
    metadata (1-D positions). Measured (docs/benchmarks.md, "Ring attention blocks": one ring step
    forward + backward, 8 q / 2 kv heads, D 64, 8k tokens a rank, H200, one group): 113-121 MiB fp32
    and 73-84 MiB bf16 where the explicit score tiles took 1.5 GiB; this model gives 152 / 104 MiB (it
    also counts the accumulators and the K/V block that travel in a real ring)."""
    if w.layout.ring == 1:
        return 0.0
    tr, box, d, e = w.heads_len, min(w.seq_len, w.stream) // w.layout.ring, head_dim, dtype_bytes
    kv = kv_heads_per_pass(tr, w.heads.q, w.heads.kv, d, 4)
    q = w.heads.q * kv // w.heads.kv if w.heads.kv else w.heads.q  # the group's q heads
    accumulators = acc_bytes(tr, q, kv, d, 4)
    blocks = 2 * 2 * tr * kv * d * e
    tile = min(box, RING_TILE_TOKENS) * q * d * (5 * e + 4)
    return accumulators + blocks + tile + 4 * 8 * box * w.layout.ring


def _backward_working_set(shape: ModelShape, w: Workload, opts: MemoryOptions, kind: LayerKind) -> float:
    """Tensors alive at once in one layer's backward besides its saved ones: the MLP's (or attention's)
    intermediate gradients, the exchanges' buffers, the residual gradients, ring attention's blocks, the
    torch banded kernel's recomputed block."""
    e, d, h, lay = opts.dtype_bytes, shape.head_dim, shape.hidden, w.layout
    tiles, width = opts.tiled_mlp_shards or 1, mlp_width(kind)
    # the MLP's backward: the gradients of its product, of the activation and of the up projection
    # (the product itself, the down projection's input, is freed by then)
    mlp = 2 * w.shard / tiles * (width // (1 if kind.mlp.moe else lay.tp)) * e
    if opts.tiled_mlp_shards:  # the tile recomputed in backward
        mlp += 4 * w.shard / tiles * width * e
    attn = 2 * w.heads_len * (w.heads.q + 2 * w.heads.kv) * d * e + block_bytes(kind, w.span(opts.flash))
    exchange = 2 * w.shard * (shape.q_heads + 2 * shape.kv_heads) // lay.tp * d * e if lay.ulysses > 1 else 0
    # tp with sequence-parallel activations: the block input re-gathered [S, h] for the projections'
    # weight gradients and its full-length gradient before the reduce-scatter
    gathers = 2 * w.shard * h * e if lay.tp_shards_tokens else 0
    return max(mlp, attn + ring_bytes(w, d, e)) + exchange + gathers + 2 * w.kept * h * e


def _head_bytes(shape: ModelShape, w: Workload, role: str, opts: MemoryOptions) -> float:
    """Backward of the output head: [chunk, vocab] fp32 logprobs and probabilities per chunk."""
    e, tokens = opts.dtype_bytes, w.kept  # the head runs on the tokens a rank keeps
    if role == "critic":
        return tokens * shape.hidden * e
    # one chunk at a time: the fp32 logit gradient formed in place (with the entropy's gradient the
    # probabilities too), and at the end its compute-dtype copy next to one fp32 buffer
    chunk = min(opts.logprob_chunk, tokens)
    per_elem = max(8 if opts.entropy_grad else 4, 4 + (e if e < 4 else 0))
    return chunk * shape.vocab * per_elem + tokens * shape.hidden * e


def activation_terms(shape: ModelShape, w: Workload, role: str, opts: MemoryOptions) -> dict[str, float]:
    """Saved activations, one layer recomputed (checkpointing), a layer's backward working set and the
    output head's backward of one training role."""
    e, h = opts.dtype_bytes, shape.hidden
    final_norm = w.kept * ((2 * h * e if opts.lean_norm else h * (4 + 2 * e)) + 4)  # its backward runs before the layers'
    shared = final_norm + w.shard * (20 + 2 * shape.head_dim * e)  # + token ids, labels, rotary tables
    kinds = shape.layer_list()
    if opts.checkpointing:
        # offload: backward holds the input of the layer it is in and the next one's, prefetched
        kept = min(2, shape.layers) if opts.activation_offload else shape.layers
        saved, recompute = kept * w.kept * h * e + shared, max(layer_saved_bytes(shape, w, opts, k) for k in kinds)
    else:
        saved, recompute = decoder_saved_bytes(shape, w, opts) + shared, 0.0
    working = max(_backward_working_set(shape, w, opts, k) for k in set(kinds))
    if shape.vision is not None and w.image_tokens and role != "critic":  # the rank's share of the images' patches
        saved += tower_saved_bytes(shape.vision, w.rank_image_tokens, e, checkpointed=opts.checkpointing)
    return {"saved": saved, "final_norm": final_norm, "recompute": recompute, "layer_backward": working,
            "head": _head_bytes(shape, w, role, opts)}


def buffer_terms(shape: ModelShape, layout: RoleLayout, role: str, e: int) -> dict[str, float]:
    """FSDP2's unsharded buffers: layers in flight, the root unit during forward/backward, and the root's
    gradient reduce at the end of backward."""
    routed = max((_routed(shape, k) for k in shape.kinds), default=0) * (1 - 1 / layout.ep)  # ep: 1/ep gathered
    layer = (shape.layer_params - routed) / layout.tp
    cast = 4 if e < 4 else 0  # gradients are reduced in fp32
    root = shape.critic_root_params if role == "critic" else shape.root_params
    head_grad = 0 if role == "critic" else shape.vocab * shape.hidden * e  # lm_head gradient, unsharded
    return {"layers_unsharded": 2 * layer * e + layer * (e + cast), "root_unsharded": root * e + head_grad,
            "root_reduce": root * (2 * e + cast)}


def role_peak(shape: ModelShape, w: Workload, role: str, opts: MemoryOptions) -> tuple[str, dict[str, float]]:
    """(phase, the parts of this role's peak above the rank's other resident state) at the role's worst
    moment: the start of backward (saved activations and the head's backward), a layer's backward
    (saved activations, the recomputed layer and its working set, or the gradients reduced so far),
    the end of backward (the root's gradients reduced) or the optimizer step."""
    act = activation_terms(shape, w, role, opts)
    buf = buffer_terms(shape, w.layout, role, opts.dtype_bytes)
    _, grads = state_bytes(shape, w.layout, role, opts.dtype_bytes)
    fsdp = {"FSDP unsharded layers": buf["layers_unsharded"], "FSDP root unit": buf["root_unsharded"]}
    if opts.param_offload:  # gradient shards leave for host memory layer by layer; the step runs on the CPU
        grads, fsdp["offload staging"] = 0.0, offload_staging_bytes(shape, w.layout)
    layer = {"recomputed layer": act["recompute"], "layer backward": act["layer_backward"]}
    phases = {
        "start of backward": {**fsdp, "saved activations": act["saved"], "output head": act["head"]},
        "layer backward": {**fsdp, "saved activations": act["saved"] - act["final_norm"], **layer},
        "layer backward, gradients reduced": {**fsdp, "gradients": grads, **layer},
        "end of backward": {"gradients": grads, "root gradient reduce": buf["root_reduce"]},
        "optimizer step": {"gradients": grads, "AdamW temporaries": grads},  # foreach: one fp32 tensor per parameter
    }
    phase = max(phases, key=lambda k: sum(phases[k].values()))
    return phase, phases[phase]


def plan_memory(shape: ModelShape, w: Workload, opts: MemoryOptions, critic: bool = False,
                ref: bool = True) -> MemoryEstimate:
    """Peak bytes per rank of a colocated run: actor and reference (and the critic, on the actor's layout),
    the larger of the actor's and the critic's update (`ref=False`: no separate reference). A role's
    gradients stay allocated from its update to the start of its next one, so they are resident while
    the other role trains. `terms` are the parts that add up to the peak."""
    e, lay = opts.dtype_bytes, w.layout
    # param offload: every role's state (and the gradients between updates) lives in host memory
    on_device = 0.0 if opts.param_offload else 1.0
    actor_state, actor_grads = (on_device * b for b in state_bytes(shape, lay, "actor", e))
    resident = {"actor state": actor_state}
    if ref:
        resident["ref state"] = on_device * state_bytes(shape, lay, "ref", e)[0]
    critic_state, critic_grads = (on_device * b for b in state_bytes(shape, lay, "critic", e)) if critic else (0.0, 0.0)
    if critic:
        resident["critic state"] = critic_state
    best = MemoryEstimate(0.0, "")
    for role, other in (("actor", ("critic gradients", critic_grads)), ("critic", ("actor gradients", actor_grads))):
        if role == "critic" and not critic:
            continue
        phase, parts = role_peak(shape, w, role, opts)
        terms = {**resident, **({other[0]: other[1]} if critic else {}),
                 **{(f"{role} {k}" if k == "gradients" else k): v for k, v in parts.items()}}
        peak = sum(terms.values())
        if peak > best.peak:
            best = MemoryEstimate(peak, f"{role} {phase}", terms)
    return best
