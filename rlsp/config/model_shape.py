"""The shape of a decoder model as the layout planner needs it, read from a Hugging Face config.json.

Only the numbers that decide memory and communication are kept: layers, hidden size, query / kv
heads and head dim, MLP width, vocabulary, whether the output layer is tied to the embedding, and the
longest position the model takes (max_position_embeddings: rlsp's start-up checks refuse longer runs).
Parameter counts follow each layer's kind (rlsp.config.layer_kinds: full / sliding-window / multi-latent / linear
attention, dense or MoE MLP, the norms and biases of the family; equal to the numel of transformers' model,
tested on tiny models of every family rlsp trains); shapes built by hand without kinds count the Llama / Qwen2
layer (q/k/v/o projections, a gated MLP of three matrices, two RMSNorms per layer; q/k/v biases where the
architecture has them). Multi-latent attention (deepseek_v2/v3): `head_dim` is the q/k head dim
(qk_nope + qk_rope), `v_head_dim` the value head dim, and kv heads equal q heads (after the latent expansion).

Vision-language checkpoints (qwen2_5_vl, qwen3_vl, qwen3_vl_moe) read as their text model (the layers of its text
equivalent, rlsp.config.vision_shape.TEXT_EQUIVALENT) plus their vision tower (`vision`), whose parameters count in
the root unit (FSDP2 shards the text layers one by one and the rest, the tower included, at once).

No torch, no transformers: the planner answers in well under a second.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlsp.config.layer_kinds import LINEAR, LayerKind, layer_kinds, uniform_layers
from rlsp.config.vision_shape import TEXT_EQUIVALENT, VisionTower, vision_tower

# Multimodal wrappers whose text model rlsp trains (text-only RL) -> their text model_type: AutoModelForCausalLM loads
# it (config = text_config; `model.language_model.*` read as `model.*`, the vision tower's `model.visual.*` skipped).
TEXT_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

# Architectures whose q/k/v projections carry a bias even though their config has no attention_bias.
_QKV_BIAS_TYPES = ("qwen2",)
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder-only LM (names as in transformers configs)."""

    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    name: str = "model"
    max_positions: int | None = None  # config.json's max_position_embeddings (None: the config sets none)
    v_head_dim: int = 0  # value head dim where it differs from head_dim (multi-latent attention); 0: head_dim
    # one per decoder layer, read from config.json (empty: every layer the Llama / Qwen2 layer above)
    kinds: tuple[LayerKind, ...] = field(default=(), compare=False, repr=False)
    model_type: str = field(default="", compare=False)
    vision: VisionTower | None = field(default=None, compare=False)  # a vision-language model's tower

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (what FSDP2 all-gathers at once): attention, MLP, norms."""
        if self.kinds:
            return max(k.params for k in self.kinds)
        h, d = self.hidden, self.head_dim
        attn = h * d * (self.q_heads + 2 * self.kv_heads) + self.q_heads * d * h
        bias = d * (self.q_heads + 2 * self.kv_heads) if self.qkv_bias else 0
        return attn + bias + 3 * h * self.intermediate + 2 * h

    def layer_list(self) -> tuple[LayerKind, ...]:
        """Every decoder layer's kind (a shape without kinds: the Llama / Qwen2 layer, `layers` times)."""
        return self.kinds or uniform_layers(self.layers, self.q_heads, self.kv_heads, self.head_dim, self.v_dim,
                                            self.intermediate, self.layer_params)

    @property
    def decoder_params(self) -> int:
        """Parameters of all decoder layers (every expert of MoE layers)."""
        return sum(k.params for k in self.kinds) if self.kinds else self.layers * self.layer_params

    @property
    def active_decoder_params(self) -> int:
        """Decoder parameters one token runs through (MoE: its routed experts only, plus the shared ones)."""
        return sum(k.active for k in self.kinds) if self.kinds else self.decoder_params

    @property
    def moe(self) -> bool:
        return any(k.mlp.moe for k in self.kinds)

    @property
    def matrix_params(self) -> int:
        """Output-layer-sized matrices outside the layers: the embedding, plus lm_head unless tied."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers (FSDP2's root unit): embedding, lm_head, final norm, vision tower."""
        return self.matrix_params + self.hidden + (self.vision.params if self.vision else 0)

    @property
    def params(self) -> int:
        return self.decoder_params + self.root_params

    def kv_cache_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """Bytes of one sequence's KV cache after `tokens` tokens, as transformers' cache keeps it: k and v per kv
        head on full layers; the last window - 1 tokens on sliding layers; multi-latent attention's compressed
        latent (kv_lora_rank + qk_rope_head_dim per token, shared by the heads); none on linear-attention layers
        (`state_bytes_per_sequence`)."""
        total = 0
        for k in self.layer_list():
            a = k.attention
            if a.kind == LINEAR:
                continue
            kept = min(tokens, a.window - 1) if a.window else tokens
            per_token = a.latent[1] + a.latent[2] if a.mla else a.kv_heads * (a.qk_dim + a.v_dim)
            total += kept * per_token * dtype_bytes
        return total

    def state_bytes_per_sequence(self, dtype_bytes: int) -> int:
        """Linear-attention layers' decoding state per sequence, as transformers' cache keeps it: the fp32
        recurrent state (key_head_dim x value_head_dim per value head) and the conv state (the kernel's width of
        past q/k/v channel inputs, in the model's dtype)."""
        total = 0
        for k in self.kinds:
            if k.attention.kind == LINEAR:
                kh, vh, kd, vd, conv = k.attention.linear
                total += vh * kd * vd * 4 + (2 * kh * kd + vh * vd) * conv * dtype_bytes
        return total

    @property
    def critic_root_params(self) -> int:
        """A value model's root: the embedding, the final norm and a [hidden -> 1] value head."""
        return self.vocab * self.hidden + 2 * self.hidden + 1

    def legal_tp(self) -> list[int]:
        """Tensor-parallel sizes that split q heads, kv heads, the dense MLPs' width and the linear-attention layers'
        key heads evenly (the same rule as rlsp.parallel.tp_checks.legal_tp_sizes, which needs torch: a MoE block runs
        replicated over tp, so its width need not divide; a Gated DeltaNet layer splits by key-head groups); 1 alone
        for a vision-language model (rlsp's tensor parallelism refuses it: rlsp.models.family_checks.check_tp_windowed;
        a Qwen3.5 wrapper's shape is its text model's, which takes tp unless the run loads the tower: rlsp.checks).
        """
        if self.tp_refusal() is not None:
            return [1]
        dense = {k.mlp.width for k in self.layer_list() if not k.mlp.moe}
        key_heads = {k.attention.linear[0] for k in self.layer_list() if k.attention.kind == LINEAR}
        common = math.gcd(self.q_heads, self.kv_heads, *dense, *key_heads)
        return [d for d in range(1, common + 1) if common % d == 0]

    def tp_refusal(self) -> str | None:
        """Why rlsp's tensor parallelism takes no tp > 1 for this model's layers whatever their sizes, or None."""
        if self.vision is not None:
            return "a vision-language model"
        return None

    def describe(self) -> str:
        tie = "tied" if self.tied else "untied"
        dims = f"dim {self.head_dim}" if self.v_dim == self.head_dim else f"q/k dim {self.head_dim}, v dim {self.v_dim}"
        active = (f" ({(self.active_decoder_params + self.root_params) / 1e9:.2f} B active per token)"
                  if self.active_decoder_params != self.decoder_params else "")
        tower = (f", vision tower {self.vision.params / 1e6:.1f} M ({self.vision.depth} blocks)" if self.vision else "")
        return (f"{self.name}: {self.layers} layers, hidden {self.hidden}, {self.q_heads} q / {self.kv_heads} kv "
                f"heads of {dims}, intermediate {self.intermediate}, vocab {self.vocab} ({tie}); "
                f"{self.params / 1e9:.2f} B parameters{active}{tower}" +
                (f"; {self.max_positions} positions" if self.max_positions else ""))


def shape_from_config(cfg: dict[str, Any], name: str = "model") -> ModelShape:
    """A ModelShape from the dict of a config.json; raises ValueError naming missing or bad fields."""
    missing = [k for k in _REQUIRED if not isinstance(cfg.get(k), int) or cfg[k] < 1]
    if missing:
        raise ValueError(f"{name}: config.json lacks positive integer fields {missing} (a decoder-only LM config "
                         f"needs {list(_REQUIRED)}; pass the text model's config, not a multimodal wrapper)")
    q = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or q
    if q % kv:
        raise ValueError(f"{name}: num_attention_heads={q} is not a multiple of num_key_value_heads={kv}")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // q
    bias = bool(cfg.get("attention_bias", cfg.get("model_type") in _QKV_BIAS_TYPES))
    try:
        kinds = tuple(layer_kinds(cfg))
    except KeyError as exc:
        raise ValueError(f"{name}: config.json of model_type={cfg.get('model_type')!r} lacks {exc.args[0]!r}, which "
                         "its layers need (pass the config.json transformers writes for the model)") from None
    softmax = [k.attention for k in kinds if k.attention.kind != LINEAR]
    if softmax and softmax[0].mla:  # multi-latent attention: every head its own k and v after the expansion
        kv, head_dim = q, softmax[0].qk_dim
    v_dim = softmax[0].v_dim if softmax and softmax[0].v_dim != head_dim else 0
    return ModelShape(layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], q_heads=q, kv_heads=kv,
                      head_dim=head_dim, intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                      tied=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=bias, name=name,
                      max_positions=_max_positions(cfg, name), v_head_dim=v_dim, kinds=kinds,
                      model_type=str(cfg.get("model_type") or ""))


def _max_positions(cfg: dict[str, Any], name: str) -> int | None:
    limit = cfg.get("max_position_embeddings")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"{name}: config.json has max_position_embeddings={limit!r}; expected an integer >= 1 or none")
    return limit


def read_model_shape(path: str | Path) -> ModelShape:
    """Read `<path>/config.json` (or `path` itself when it is the file)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"no config.json at {file}: pass a model directory (Hugging Face layout) or its config.json")
    return shape_of_config(json.loads(file.read_text()), p.name if p.is_dir() else p.parent.name)


def shape_of_config(config: dict[str, Any], name: str = "model") -> ModelShape:
    """The shape of a whole config.json's dict as rlsp trains the model: a Qwen3.5 wrapper's text model, a
    vision-language model's text model with its tower, any other decoder as it is."""
    if config.get("model_type") in TEXT_WRAPPERS and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a Qwen3.5 wrapper checkpoint: rlsp trains its text model alone
    mt = config.get("model_type")
    if mt in TEXT_EQUIVALENT and isinstance(config.get("text_config"), dict):  # trained with its vision tower
        # transformers ties by the top-level config's word (Qwen3-VL-MoE's text config may say otherwise)
        tied = config.get("tie_word_embeddings", config["text_config"].get("tie_word_embeddings", False))
        text = {**config["text_config"], "model_type": TEXT_EQUIVALENT[mt], "tie_word_embeddings": tied}
        shape = shape_from_config(text, name=name)
        return replace(shape, model_type=mt, vision=vision_tower(mt, config.get("vision_config") or {}))
    return shape_from_config(config, name=name)
