"""Memory per rank of a training layout: model state sharded per the layout, activations, buffers.

Every number is bytes on ONE rank, for one micro-batch stream of `budget x token_shards` tokens
(the budget is `*_max_token_len_per_gpu`). Terms (e = compute dtype bytes):
  state      trainable role: fp32 master 4 + fp32 gradient 4 + AdamW 8 bytes per parameter; frozen
             reference: e per parameter. Layer weights are split over tp (but for what `tp_replicated` counts
             whole: MoE routers, routed experts whose width tp does not split (rlsp.parallel.tp_experts
             splits the others), MLA latents, Gated DeltaNet's replicated weights) and then over the FSDP
             shard group;
             the embedding, lm_head and final norm are replicated over tp (rlsp's TP plan) and sharded over
             the FSDP group. Parameters count every layer by its kind (MoE: every expert); with
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

from rlsp.config.layer_kinds import LINEAR, LayerKind
from rlsp.config.layout import RoleLayout
from rlsp.config.model_shape import ModelShape
from rlsp.parallel.tp_experts import SPLIT_EXPERT_FAMILIES, width_splits
from rlsp.plan.activations import (
    RING_TILE_TOKENS,
    activation_terms,
    decoder_saved_bytes,
    layer_saved_bytes,
    ring_bytes,
)
from rlsp.plan.workload import HeadShare, MemoryOptions, Workload

# The model's inputs and activation terms live in rlsp.plan.workload and rlsp.plan.activations; importable from here.
__all__ = ["GIB", "RING_TILE_TOKENS", "ROLES", "HeadShare", "MemoryEstimate", "MemoryOptions", "Workload",
           "activation_terms", "buffer_terms", "decoder_saved_bytes", "layer_saved_bytes", "offload_staging_bytes",
           "plan_memory", "ring_bytes", "role_peak", "state_bytes"]

GIB = 2**30
ROLES = ("actor", "ref", "critic")


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
    whole = sum(tp_replicated(shape, k, layout) for k in shape.kinds)  # what tp holds whole on every rank
    split = shape.decoder_params - routed - whole
    params = (split / layout.tp + whole + root) / layout.fsdp_shard + routed / layout.fsdp_ranks
    if role == "ref":
        return params * e, 0.0
    return params * 12.0, params * 4.0  # fp32 master + AdamW moments; fp32 gradients


def _routed(shape: ModelShape, kind: LayerKind) -> int:
    """A layer's routed-expert parameters (gated: gate, up and down per expert)."""
    return kind.mlp.experts * 3 * shape.hidden * kind.mlp.width


def tp_replicated(shape: ModelShape, kind: LayerKind, layout: RoleLayout, active: bool = False) -> float:
    """A layer's parameters that tp does not split: under tp > 1 its MoE block's router, its routed experts unless
    tp splits them by their width (rlsp.parallel.tp_experts: the SPLIT_EXPERT_FAMILIES where tp divides the expert
    and the shared width into multiples of 8, `width_splits`; else rlsp.parallel.tp_families.LocalReplicatedMoE
    runs them replicated), its shared experts where tp does not divide their width (else split like a dense MLP)
    and multi-latent attention's latent projections (`_latent`), and a Gated DeltaNet layer's replicated weights
    (`_linear_replicated`; not with `active`: a rank computes its own rows of them only); `active`: those one
    token runs through (its routed experts only)."""
    if layout.tp == 1:
        return 0
    linear = 0 if active else _linear_replicated(shape, kind)
    if not kind.mlp.moe:
        return _latent(shape, kind) + linear
    shared_split = kind.mlp.shared % layout.tp == 0
    split = (shape.model_type in SPLIT_EXPERT_FAMILIES and width_splits(kind.mlp.width, layout.tp)
             and (kind.mlp.shared == 0 or width_splits(kind.mlp.shared, layout.tp)))
    routed = 0 if split else _routed(shape, kind) * (kind.mlp.active / kind.mlp.experts if active else 1)
    shared = 0 if shared_split else 3 * shape.hidden * kind.mlp.shared
    return routed + shape.hidden * kind.mlp.experts + shared + _latent(shape, kind) + linear


def _linear_replicated(shape: ModelShape, kind: LayerKind) -> int:
    """A Gated DeltaNet layer's parameters tp holds whole on every rank (rlsp.parallel.tp_linear_attention): the
    conv1d weight, A_log, dt_bias, the gated norm's weight and, but for Qwen3-Next's per-group fused projections,
    the [q | k | v] input projection (in_proj_qkv)."""
    if kind.attention.kind != LINEAR:
        return 0
    kh, vh, kd, vd, conv = kind.attention.linear
    channels = 2 * kh * kd + vh * vd
    return (0 if shape.model_type == "qwen3_next" else shape.hidden * channels) + channels * conv + 2 * vh + vd


def _latent(shape: ModelShape, kind: LayerKind) -> int:
    """Multi-latent attention's latent projections and norms (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa,
    kv_a_layernorm), replicated over tp (rlsp.parallel.tp_latent); their biases (attention_bias, off in the
    DeepSeek checkpoints) are counted as split."""
    if not kind.attention.mla:
        return 0
    q_rank, kv_rank, rope = kind.attention.latent
    return (shape.hidden + 1) * q_rank + shape.hidden * (kv_rank + rope) + kv_rank


def gathered_layer_params(shape: ModelShape, layout: RoleLayout) -> float:
    """Parameters of the largest decoder layer on one rank once FSDP2 all-gathers it: split over tp but for a
    MoE block (`tp_replicated`), with ep only 1/ep of its routed experts."""
    def one(kind: LayerKind) -> float:
        whole = tp_replicated(shape, kind, layout)
        return (kind.params - whole) / layout.tp + whole - _routed(shape, kind) * (1 - 1 / layout.ep)
    return max(one(kind) for kind in shape.layer_list())


def offload_staging_bytes(shape: ModelShape, layout: RoleLayout) -> float:
    """Param offload's device copies of fp32 shards: the two layers in flight copied in before their
    all-gather, and one layer's reduced gradient shard before it is copied out."""
    return 3 * gathered_layer_params(shape, layout) / layout.fsdp_shard * 4


def buffer_terms(shape: ModelShape, layout: RoleLayout, role: str, e: int) -> dict[str, float]:
    """FSDP2's unsharded buffers: layers in flight, the root unit during forward/backward, and the root's
    gradient reduce at the end of backward."""
    layer = gathered_layer_params(shape, layout)
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
