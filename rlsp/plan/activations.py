"""Activation terms of the planner's memory model (rlsp.plan.memory): what a training role's layers save for
backward, one recomputed layer, a layer's backward working set (ring attention's fused tiles included), the output
head's backward, and the vision tower's saved activations for the rank's share of the images. The per-layer-kind
terms are rlsp.config.auto_memory's (shared with the `auto` checkpointing rule); the module docstring of
rlsp.plan.memory says what each term holds.

Legend: T stream tokens, S tokens of a sequence shard, s tokens a rank keeps outside the projections, Tr tokens
inside attention, hq / hkv the rank's heads inside attention, D head dim.
"""

from __future__ import annotations

from rlsp.config.auto_memory import attention_saved_bytes, block_bytes, mlp_saved_bytes, mlp_width
from rlsp.config.layer_kinds import LayerKind
from rlsp.config.model_shape import ModelShape
from rlsp.config.vision_shape import tower_saved_bytes
from rlsp.parallel.ring_heads import acc_bytes, kv_heads_per_pass
from rlsp.plan.workload import MemoryOptions, Workload


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
    """Bytes all decoder layers save for backward without checkpointing (each by its kind, computed once a kind and
    summed in layer order)."""
    kinds = shape.layer_list()
    per_kind = {kind: layer_saved_bytes(shape, w, opts, kind) for kind in set(kinds)}
    return sum(per_kind[kind] for kind in kinds)


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
        saved, recompute = kept * w.kept * h * e + shared, max(layer_saved_bytes(shape, w, opts, k) for k in set(kinds))
    else:
        saved, recompute = decoder_saved_bytes(shape, w, opts) + shared, 0.0
    working = max(_backward_working_set(shape, w, opts, k) for k in set(kinds))
    if shape.vision is not None and w.image_tokens:  # the rank's share of the images' patches (actor or critic)
        saved += tower_saved_bytes(shape.vision, w.rank_image_tokens, e, checkpointed=opts.checkpointing)
    return {"saved": saved, "final_norm": final_norm, "recompute": recompute, "layer_backward": working,
            "head": _head_bytes(shape, w, role, opts)}
