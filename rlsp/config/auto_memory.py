"""The `auto` rule of gradient checkpointing (`*.model.enable_gradient_checkpointing`, rlsp.config.auto), and the
per-layer activation terms it shares with the planner (rlsp.plan.memory).

Checkpointing trades a second forward of every layer in backward for keeping only each layer's input.
It is worth it when the activations a micro-batch saves without it do not fit beside the training
state: on when

    activations(micro-batch tokens) > (rank memory - training state per rank) / 2

(the other half: the backward's working set, the vocab-chunked logprob head, the allocator's slack).
`activation_bytes` is the planner's saved bytes of every decoder layer (rlsp.plan.memory) for a rank that holds
whole sequences and every head (no sequence, tensor or tiled-MLP split; HF's RMSNorm), divided by the
sequence- and tensor-parallel degrees the role runs with; tests/unit/test_auto_settings.py compares
the two. Memory unknown here: off (verl's default), said so.
A vision-language actor adds its tower's saved activations for the image tokens of the rank's share of the
micro-batch (rlsp.config.auto_vision: the data's largest row, counted at start-up, or data.max_prompt_length).

What one layer saves for backward, by kind (rlsp.config.layer_kinds; e the compute dtype's bytes):
  softmax attention  q, k, v and the output over the rank's heads and its attention tokens, with their own head
                     dims (multi-latent attention: q/k qk_nope + qk_rope, v v_head_dim, kv heads = q heads), the
                     fp32 log-sum-exp, o_proj's input; the output gate of gated-q layers; MLA's latent tensors
                     (q_a and kv_a outputs before and after their norms, kv_b's output).
  windowed layers    on the torch banded kernel (no flash_attn, rlsp/models/window_attention.py) SDPA keeps each
                     block's probabilities: window + WINDOW_CHUNK - 1 keys per query at most, O(tokens x window),
                     not the causal prefix; soft-capped or sink layers recompute each block in backward instead
                     (its [q, WINDOW_CHUNK, keys] fp32 scores, probabilities and their gradient: `block_bytes`).
  linear attention   the projections' outputs; per rank (its key-head groups after the exchange) the conv's input
                     and output and the delta rule's output; the fp32 recurrent state (key_head_dim x
                     value_head_dim per value head) at every DELTA_CHUNK-token chunk boundary (transformers' chunked
                     rule); the gated norm's inputs and out_proj's input. No KV cache.
  MLP                dense: gate, up, activation and product ([tokens, I/tp] each); MoE: the same for each token's
                     active experts and the shared experts, the fp32 router logits and each token's copy per expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlsp.config.auto_vision import RowImages, image_saved_bytes
from rlsp.config.layer_kinds import LINEAR, Attention, LayerKind
from rlsp.config.layout_build import has_reference
from rlsp.config.machine import GIB, Machine
from rlsp.config.model_shape import ModelShape

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
WINDOW_CHUNK = 256  # query rows of a block of the torch banded kernel (rlsp/models/window_attention.py _CHUNK)
DELTA_CHUNK = 64  # tokens per chunk of transformers' torch chunk_gated_delta_rule


@dataclass(frozen=True)
class RankSpan:
    """One rank's share of a layer: `attn` tokens inside attention (its ring share of the stream), `shard` tokens
    of its sequence shard, `q` / `kv` its heads inside attention, the Ulysses and tp degrees, the longest sequence
    (0: unknown), whether flash_attn runs windowed / soft-capped layers (CUDA with flash_attn installed), whether
    o_proj keeps an input of its own (not with ring alone: attention's output is it)."""

    attn: int
    shard: int
    q: int
    kv: int
    ulysses: int = 1
    tp: int = 1
    seq_len: int = 0
    flash: bool = True
    o_input: bool = True


def _torch_path(a: Attention, s: RankSpan) -> bool:
    """Whether the layer takes rlsp's torch banded kernel (sinks always: flash_attn has none)."""
    return a.sinks or (not s.flash and (a.window is not None or a.softcap is not None))


def _band_keys(a: Attention, s: RankSpan) -> int:
    """Keys per query of a block of the torch banded kernel."""
    limit = s.seq_len or s.attn
    return min(limit, a.window + WINDOW_CHUNK - 1) if a.window else limit


def block_bytes(kind: LayerKind, s: RankSpan) -> float:
    """A recomputed block's working set in backward (soft-capped / sink layers on the torch path), else 0."""
    a = kind.attention
    if a.kind == LINEAR or not _torch_path(a, s) or not (a.softcap or a.sinks):
        return 0.0
    return 3 * s.q * min(WINDOW_CHUNK, s.attn) * _band_keys(a, s) * 4


def _linear_saved(a: Attention, s: RankSpan, e: int) -> float:
    kh, vh, kd, vd, _ = a.linear
    groups = -(-kh // s.ulysses)  # key-head groups on the busiest rank
    kr, vr = groups, groups * (vh // kh)
    local = s.shard * (2 * kh * kd + 2 * vh * vd + 2 * vh) * e  # q, k, v, z, b, a before the exchange
    rank = s.attn * (2 * (2 * kr * kd + vr * vd) + vr * vd) * e  # conv input and output, the rule's output
    states = -(-s.attn // DELTA_CHUNK) * vr * kd * vd * 4
    return local + rank + states + s.shard * 3 * vh * vd * e  # gated norm input and z, out_proj's input


def attention_saved_bytes(kind: LayerKind, q_heads: int, s: RankSpan, e: int) -> float:
    """Bytes one layer's attention block saves for backward on a rank (`q_heads`: the model's q heads)."""
    a = kind.attention
    if a.kind == LINEAR:
        return _linear_saved(a, s, e)
    out = s.attn * (((s.q + s.kv) * a.qk_dim + (s.kv + s.q) * a.v_dim) * e + s.q * 4)
    heads = q_heads // s.tp
    out += s.shard * heads * (a.v_dim * s.o_input + a.qk_dim * a.gated_q) * e
    if a.mla:
        q_rank, kv_rank, rope = a.latent
        out += s.shard * (2 * q_rank + 2 * kv_rank + rope + heads * (a.qk_dim - rope + a.v_dim)) * e
    if _torch_path(a, s) and not (a.softcap or a.sinks):  # SDPA's probabilities of every block, kept
        out += s.attn * s.q * _band_keys(a, s) * e
    return out


def mlp_width(kind: LayerKind) -> int:
    """The MLP width one token runs through (MoE: its active experts and the shared ones)."""
    m = kind.mlp
    return m.active * m.width + m.shared if m.moe else m.width


def mlp_saved_bytes(kind: LayerKind, hidden: int, s: RankSpan, e: int) -> float:
    m = kind.mlp
    if not m.moe:
        return 4 * s.shard * (m.width // s.tp) * e
    return 4 * s.shard * mlp_width(kind) * e + s.shard * (m.experts * 4 + m.active * (hidden * e + 12))


def activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, splits: int = 1, flash: bool = True) -> float:
    """Bytes the decoder layers save for backward over `tokens` tokens without checkpointing, on a rank
    of a role split `splits` ways (sequence x tensor parallel); `flash`: flash_attn runs windowed layers."""
    e, h = dtype_bytes, shape.hidden
    norms = 2 * (h * (4 + e) + 4 + h * e)  # two norms: fp32 upcast, normed value, 1/rms; the normed input
    span = RankSpan(tokens, tokens, shape.q_heads, shape.kv_heads, seq_len=tokens, flash=flash)
    total = sum(tokens * norms + attention_saved_bytes(k, shape.q_heads, span, e) + mlp_saved_bytes(k, h, span, e)
                for k in shape.layer_list())
    return total / splits


def micro_batch_tokens(section: Any, prompt_len: int, response_len: int) -> int:
    """Tokens of one training micro-batch on a rank: the token budget, or rows x the longest sequence."""
    if section.use_dynamic_bsz is True:
        return int(section.ppo_max_token_len_per_gpu)
    return int(section.ppo_micro_batch_size_per_gpu) * (prompt_len + response_len)


def checkpointing_choice(shape: ModelShape | None, why: str, machine: Machine, memory: float | None, state: float,
                         tokens: int, dtype: str, splits: int, images: RowImages | None = None,
                         seq_len: int = 0) -> tuple[bool, str]:
    """(enable_gradient_checkpointing, reason) for a role with `state` bytes per rank and `memory` bytes
    of the rank left to training (None: unknown); `images` the rows' image tokens (a vision-language actor, rows of
    up to `seq_len` tokens): the tower's activations count too (rlsp.config.auto_vision)."""
    if shape is None or memory is None:
        return False, f"{why or machine.source}: off (verl's default)"
    # flash_attn runs windowed layers only on cuda (when installed: assumed); cpu takes the torch banded kernel
    e = DTYPE_BYTES.get(dtype, 4)
    saved = activation_bytes(shape, tokens, e, splits, flash=machine.device == "cuda")
    rank_images, tower = image_saved_bytes(shape, images, tokens, seq_len, e, splits)
    saved += tower
    room = (memory - state) / 2
    vision = (f" ({images.source}; the vision tower saves {tower / GIB:.2f} GiB for the {rank_images} on a rank)"
              if images is not None and tower else "")
    text = (f"{tokens} tokens a micro-batch{vision} save {saved / GIB:.2f} GiB of activations "
            f"{'>' if saved > room else '<='} half of the {max(0.0, memory - state) / GIB:.1f} GiB the training "
            "state leaves")
    return saved > room, f"{text}: {'on' if saved > room else 'off'}"


EP_ROLES = (("actor", "actor_rollout_ref.actor"), ("ref", "actor_rollout_ref.ref"), ("critic", "critic.model"))
EP_STATE_BYTES, EP_REFERENCE_BYTES = 16, 4  # fp32 weight + gradient + AdamW's two moments; the reference's weights


def routed_params(shape: ModelShape) -> tuple[int, int, int]:
    """(routed-expert parameters of every MoE layer, of the largest one, experts per MoE layer; zeros when dense):
    gate, up and down per expert, as the planner counts them (rlsp.plan.memory)."""
    per_layer = [(k.mlp.experts * 3 * shape.hidden * k.mlp.width, k.mlp.experts) for k in shape.layer_list()
                 if k.mlp.moe]
    if not per_layer:
        return 0, 0, 0
    return sum(p for p, _ in per_layer), max(p for p, _ in per_layer), per_layer[0][1]


def ep_rank_bytes(shape: ModelShape, ep: int, ranks: int, fsdp_ranks: int, dtype_bytes: int,
                  state_bytes: float = EP_STATE_BYTES) -> float:
    """A rank's training state (`state_bytes` a parameter) plus FSDP2's gathered routed experts at expert-parallel
    degree `ep`: the experts are sharded over all `ranks` with ep > 1 (over `fsdp_ranks`, like every other
    parameter, at 1), and one layer's gathered experts, two layers in flight plus its unsharded gradients, are
    1/ep of them (rlsp.plan.memory's state and buffer terms)."""
    routed, layer, _ = routed_params(shape)
    state = (shape.params - routed) * state_bytes / fsdp_ranks + routed * state_bytes / (ranks if ep > 1 else fsdp_ranks)
    cast = 4 if dtype_bytes < 4 else 0  # gradients are reduced in fp32
    return state + layer / ep * (3 * dtype_bytes + cast)


def ep_value(shape: ModelShape | None, why: str, memory: float | None, ranks: int, fsdp_ranks: int, dtype_bytes: int,
             state_bytes: float = EP_STATE_BYTES, blocker: str = "") -> tuple[int, str]:
    """expert_parallel_size for a role of `ranks` ranks (`blocker`: a setting that rules EP out), with the reason:
    1 for a dense model or when the rank's state and gathered experts take at most half of `memory` (the other
    half: activations and the backward's working set, as the checkpointing rule keeps it); else the smallest
    degree dividing both the ranks and the experts that fits (none: the largest such degree)."""
    if shape is None or memory is None:
        return 1, f"{why or 'the rank memory is unknown here'}: 1"
    routed, _, experts = routed_params(shape)
    if not routed:
        return 1, f"{shape.name} is dense (no routed experts): 1"
    if blocker:
        return 1, f"{blocker}: 1 (expert parallelism needs tensor_model_parallel_size=1 and a fixed Ulysses degree)"
    budget = memory / 2

    def text(ep: int) -> str:
        need = ep_rank_bytes(shape, ep, ranks, fsdp_ranks, dtype_bytes, state_bytes)
        return (f"training state + gathered experts at EP {ep}: {need / GIB:.2f} GiB per rank "
                f"{'<=' if need <= budget else '>'} half of {memory / GIB:.1f} GiB")

    if ep_rank_bytes(shape, 1, ranks, fsdp_ranks, dtype_bytes, state_bytes) <= budget:
        return 1, f"{text(1)}: every rank runs every expert"
    legal = [d for d in range(2, ranks + 1) if ranks % d == 0 and experts % d == 0]
    if not legal:
        return 1, f"{text(1)}, and no degree > 1 divides both the {ranks} ranks and the {experts} experts: 1"
    fits = [d for d in legal if ep_rank_bytes(shape, d, ranks, fsdp_ranks, dtype_bytes, state_bytes) <= budget]
    ep = fits[0] if fits else legal[-1]
    because = "the smallest degree dividing" if fits else "none fits: the largest degree dividing"
    return ep, f"{text(1)}; {text(ep)}: {because} both the {ranks} ranks and the {experts} experts"


def _role_ep(cfg: Any, role: str, shape: ModelShape | None, why: str, memory: float | None) -> tuple[int, str]:
    """ep_value for the trainable role 'actor' or 'critic' of `cfg` (its fsdp_size already resolved)."""
    section, model = (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model) if role == "actor" else \
        (cfg.critic, cfg.critic.model)
    fsdp = section.fsdp_config if role == "actor" else cfg.critic.model.fsdp_config
    own_pool = role == "critic" and not cfg.critic.colocate
    ranks = section.nnodes * section.n_gpus_per_node if own_pool else cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    tp = max(1, int(section.tensor_model_parallel_size))
    blockers = [f"{role} tensor_model_parallel_size={tp}"] if tp > 1 else []
    blockers += ["sequence_parallel_adaptive=true"] if section.sequence_parallel_adaptive else []
    fsdp_ranks = ranks // tp if fsdp.fsdp_size in (-1, "auto") else int(fsdp.fsdp_size)
    state = EP_STATE_BYTES + (EP_REFERENCE_BYTES if role == "actor" and has_reference(cfg) else 0)
    dtype = DTYPE_BYTES.get(str(model.dtype or cfg.actor_rollout_ref.model.dtype), 4)
    return ep_value(shape, why, memory, ranks, max(1, fsdp_ranks), dtype, state, ", ".join(blockers))


def ep_choices(cfg: Any, shapes: dict[str, tuple[ModelShape | None, str]],
               memory: float | None) -> list[tuple[str, int, str]]:
    """(key, value, reason) of every `auto` fsdp_config.expert_parallel_size (rlsp.config.auto): the actor's and
    the critic's by `ep_value`, the reference following the actor (it runs the actor's layout)."""
    out: list[tuple[str, int, str]] = []
    fsdp = {"actor": cfg.actor_rollout_ref.actor.fsdp_config, "ref": cfg.actor_rollout_ref.ref.fsdp_config,
            "critic": cfg.critic.model.fsdp_config}
    actor_ep = fsdp["actor"].expert_parallel_size
    for role, prefix in EP_ROLES:
        if fsdp[role].expert_parallel_size != "auto":
            continue
        key = f"{prefix}.fsdp_config.expert_parallel_size"
        if role == "ref":
            out.append((key, actor_ep if actor_ep != "auto" else out[0][1], "the reference follows the actor"))
        else:
            out.append((key, *_role_ep(cfg, role, *shapes[role], memory)))
    return out
