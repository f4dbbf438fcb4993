"""Per-layer kinds of a decoder model, read from a Hugging Face config.json dict: what each decoder layer's
attention and MLP are, with their exact parameter counts.

The families rlsp trains mix layer kinds (docs/models.md): full and sliding-window attention (gemma2,
gemma3_text, gpt_oss; gpt_oss with attention sinks), multi-latent attention (deepseek_v2/v3: q/k head dim
qk_nope + qk_rope, v head dim v_head_dim, as many kv heads as q heads after the latent expansion), Gated
DeltaNet linear attention (qwen3_next, qwen3_5_text, qwen3_5_moe_text), dense or MoE MLPs. Parameter counts
follow transformers' modules of each family (tests/unit/test_model_shape_families.py compares them with the
numel of transformers' models built from tiny configs, exactly); a family not named here counts as the
Llama / Qwen2 layer. Layer types other than full, sliding and linear attention are refused by name.

No torch, no transformers: the planner and rlsp.check read these in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
LAYER_TYPES = (FULL, SLIDING, LINEAR)
MLA_TYPES = ("deepseek_v2", "deepseek_v3")
_GATED_Q_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # q projection doubled by an output gate
_HEAD_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", *_GATED_Q_TYPES)  # q_norm / k_norm over one head dim
_FOUR_NORM_TYPES = ("gemma2", "gemma3_text")  # pre/post attention and pre/post feed-forward norms
_NO_O_BIAS_TYPES = ("qwen2", "qwen2_moe", "glm4_moe", "mistral", "phi3")
_ALL_MOE_TYPES = ("mixtral", "olmoe", "gpt_oss", "qwen3_5_moe_text")
_SPARSE_STEP_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_next")  # mlp_only_layers / decoder_sparse_step
_FIRST_DENSE_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe")  # first_k_dense_replace dense layers, then MoE
_GATED_SHARED_TYPES = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")  # shared expert with a [h -> 1] gate


@dataclass(frozen=True)
class Attention:
    """One layer's attention: `kind` one of LAYER_TYPES. Softmax layers: q / kv heads, the q/k and v head dims
    (equal but for MLA), `window` (sliding layers), `sinks`, `mla` (its latent ranks in `latent`).
    Linear layers: key / value heads and dims and the conv kernel in `linear` (kh, vh, kd, vd, conv)."""

    kind: str
    q_heads: int = 0
    kv_heads: int = 0
    qk_dim: int = 0
    v_dim: int = 0
    window: int | None = None
    sinks: bool = False
    softcap: float | None = None
    mla: bool = False
    gated_q: bool = False
    latent: tuple[int, int, int] = (0, 0, 0)  # (q_lora_rank or 0, kv_lora_rank, qk_rope_head_dim)
    linear: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)


@dataclass(frozen=True)
class Mlp:
    """One layer's MLP: dense of width `width`, or MoE of `experts` experts of width `width`, `active` per token,
    plus shared experts of total width `shared` (0: none)."""

    width: int
    experts: int = 0
    active: int = 0
    shared: int = 0

    @property
    def moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class LayerKind:
    """A decoder layer: its attention, its MLP, its parameter count and the parameters one token runs through
    (`active`: the routed experts it is not sent to left out)."""

    attention: Attention
    mlp: Mlp
    params: int
    active: int


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key)
    return default if value is None else value


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """config.layer_types (every layer full attention when the config has none); ValueError on other kinds."""
    layers = cfg["num_hidden_layers"]
    types = list(_get(cfg, "layer_types", [FULL] * layers))
    if len(types) != layers:
        raise ValueError(f"{cfg.get('model_type')}: layer_types has {len(types)} entries for num_hidden_layers="
                         f"{layers}; expected one per layer")
    if other := sorted(set(types) - set(LAYER_TYPES)):
        raise ValueError(f"{cfg.get('model_type')}: layer types {other} have no shape model in rlsp's planner "
                         f"(known: {list(LAYER_TYPES)})")
    return types


def _attention(cfg: dict[str, Any], kind: str) -> Attention:
    mt = cfg.get("model_type")
    q = cfg["num_attention_heads"]
    if kind == LINEAR:
        return Attention(LINEAR, linear=(cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                                         cfg["linear_key_head_dim"], cfg["linear_value_head_dim"],
                                         cfg["linear_conv_kernel_dim"]))
    if mt in MLA_TYPES:
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        return Attention(kind, q, q, qk, cfg["v_head_dim"], mla=True,
                         latent=(_get(cfg, "q_lora_rank", 0), cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]))
    d = _get(cfg, "head_dim", cfg["hidden_size"] // q)
    window = cfg.get("sliding_window") if kind == SLIDING else None
    return Attention(kind, q, _get(cfg, "num_key_value_heads", q), d, d, window=window, sinks=mt == "gpt_oss",
                     softcap=cfg.get("attn_logit_softcapping"), gated_q=mt in _GATED_Q_TYPES)


def _experts(cfg: dict[str, Any]) -> int:
    """Routed experts (transformers writes num_local_experts, num_experts or n_routed_experts by family)."""
    return _get(cfg, "num_local_experts", _get(cfg, "num_experts", _get(cfg, "n_routed_experts", 0)))


def _is_moe(cfg: dict[str, Any], i: int) -> bool:
    mt = cfg.get("model_type")
    if mt in _ALL_MOE_TYPES:
        return True
    if mt in _SPARSE_STEP_TYPES:
        return (i not in _get(cfg, "mlp_only_layers", []) and _experts(cfg) > 0
                and (i + 1) % _get(cfg, "decoder_sparse_step", 1) == 0)
    if mt in _FIRST_DENSE_TYPES:
        return i >= _get(cfg, "first_k_dense_replace", 0)
    return False


def _mlp(cfg: dict[str, Any], i: int) -> Mlp:
    if not _is_moe(cfg, i):
        return Mlp(cfg["intermediate_size"])
    mt = cfg.get("model_type")
    width = _get(cfg, "moe_intermediate_size", cfg["intermediate_size"])
    if mt in _GATED_SHARED_TYPES:
        shared = _get(cfg, "shared_expert_intermediate_size", 0)
    else:
        shared = width * _get(cfg, "n_shared_experts", 0)
    return Mlp(width, _experts(cfg), cfg["num_experts_per_tok"], shared)


def _softmax_params(cfg: dict[str, Any], a: Attention) -> int:
    h, mt, bias = cfg["hidden_size"], cfg.get("model_type"), bool(cfg.get("attention_bias"))
    q_out = a.q_heads * a.qk_dim * (2 if a.gated_q else 1)
    weights = h * q_out + 2 * h * a.kv_heads * a.qk_dim + a.q_heads * a.qk_dim * h
    qkv_bias = {"qwen2": True, "qwen2_moe": bool(cfg.get("qkv_bias")), "mistral": False, "phi3": False}.get(mt, bias)
    o_bias = bool(cfg.get("attention_out_bias")) if mt == "seed_oss" else bias and mt not in _NO_O_BIAS_TYPES
    biases = (q_out + 2 * a.kv_heads * a.qk_dim) * qkv_bias + h * o_bias
    if mt in _HEAD_NORM_TYPES or (mt == "glm4_moe" and cfg.get("use_qk_norm")):
        norms = 2 * a.qk_dim
    else:
        norms = (a.q_heads + a.kv_heads) * a.qk_dim if mt == "olmoe" else 0
    return weights + biases + norms + a.q_heads * a.sinks


def _mla_params(cfg: dict[str, Any], a: Attention) -> int:
    h, heads, bias = cfg["hidden_size"], a.q_heads, bool(cfg.get("attention_bias"))
    q_rank, kv_rank, rope = a.latent
    q = (h * q_rank + q_rank * bias + q_rank + q_rank * heads * a.qk_dim) if q_rank else h * heads * a.qk_dim
    kv = h * (kv_rank + rope) + (kv_rank + rope) * bias + kv_rank + kv_rank * heads * (a.qk_dim - rope + a.v_dim)
    return q + kv + heads * a.v_dim * h + h * bias


def _linear_params(cfg: dict[str, Any], a: Attention) -> int:
    h = cfg["hidden_size"]
    kh, vh, kd, vd, conv = a.linear
    key, value = kh * kd, vh * vd
    projections = h * (2 * key + 2 * value + 2 * vh) + value * h  # q, k, v, z, b, a in; out
    return projections + (2 * key + value) * conv + 2 * vh + vd  # conv1d, dt_bias and A_log, gated norm


def _expert_params(cfg: dict[str, Any], m: Mlp) -> int:
    """One routed expert's parameters (gpt_oss's carry biases)."""
    h = cfg["hidden_size"]
    return 3 * h * m.width + (2 * m.width + h if cfg.get("model_type") == "gpt_oss" else 0)


def _mlp_params(cfg: dict[str, Any], m: Mlp) -> int:
    h = cfg["hidden_size"]
    if not m.moe:
        return 3 * h * m.width + (2 * m.width + h) * bool(cfg.get("mlp_bias"))
    if cfg.get("model_type") == "gpt_oss":  # router bias, expert biases
        return h * m.experts + m.experts + m.experts * _expert_params(cfg, m)
    shared_gate = h if m.shared and cfg.get("model_type") in _GATED_SHARED_TYPES else 0
    return h * m.experts + _expert_params(cfg, m) * m.experts + 3 * h * m.shared + shared_gate


def uniform_layers(layers: int, q: int, kv: int, head_dim: int, v_dim: int, width: int, params: int) -> tuple[LayerKind, ...]:
    """`layers` identical full-attention, dense-MLP layers (a shape built by hand, without a config.json)."""
    return (LayerKind(Attention(FULL, q, kv, head_dim, v_dim), Mlp(width), params, params),) * layers


def layer_kinds(cfg: dict[str, Any]) -> list[LayerKind]:
    """One LayerKind per decoder layer of the config dict (a config.json; keys as transformers writes them)."""
    out = []
    norms = (4 if cfg.get("model_type") in _FOUR_NORM_TYPES else 2) * cfg["hidden_size"]
    for i, kind in enumerate(layer_types(cfg)):
        a, m = _attention(cfg, kind), _mlp(cfg, i)
        attn = _linear_params(cfg, a) if kind == LINEAR else _mla_params(cfg, a) if a.mla else _softmax_params(cfg, a)
        params = attn + _mlp_params(cfg, m) + norms
        out.append(LayerKind(a, m, params, params - (m.experts - m.active) * _expert_params(cfg, m)))
    return out
