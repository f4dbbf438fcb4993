"""The shape of a decoder model as the layout planner needs it, read from a Hugging Face config.json.

Only the numbers that decide memory and communication are kept: layers, hidden size, query / kv
heads and head dim, MLP width, vocabulary, whether the output layer is tied to the embedding, and the
longest position the model takes (max_position_embeddings: rlsp's start-up checks refuse longer runs).
Parameter counts follow the Llama / Qwen2 layer rlsp trains (q/k/v/o projections, a gated MLP of
three matrices, two RMSNorms per layer; q/k/v biases where the architecture has them).

No torch, no transformers: the planner answers in well under a second.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention, gated MLP, two norms."""
        h, d = self.hidden, self.head_dim
        attn = h * d * (self.q_heads + 2 * self.kv_heads) + self.q_heads * d * h
        bias = d * (self.q_heads + 2 * self.kv_heads) if self.qkv_bias else 0
        return attn + bias + 3 * h * self.intermediate + 2 * h

    @property
    def matrix_params(self) -> int:
        """Output-layer-sized matrices outside the layers: the embedding, plus lm_head unless tied."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers (FSDP2's root unit): embedding, lm_head, final norm."""
        return self.matrix_params + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def critic_root_params(self) -> int:
        """A value model's root: the embedding, the final norm and a [hidden -> 1] value head."""
        return self.vocab * self.hidden + 2 * self.hidden + 1

    def legal_tp(self) -> list[int]:
        """Tensor-parallel sizes that split q heads, kv heads and the MLP width evenly (the same rule
        as rlsp.parallel.tensor_parallel.legal_tp_sizes, which needs torch)."""
        common = math.gcd(self.q_heads, self.kv_heads, self.intermediate)
        return [d for d in range(1, common + 1) if common % d == 0]

    def describe(self) -> str:
        tie = "tied" if self.tied else "untied"
        return (f"{self.name}: {self.layers} layers, hidden {self.hidden}, {self.q_heads} q / {self.kv_heads} kv "
                f"heads of dim {self.head_dim}, intermediate {self.intermediate}, vocab {self.vocab} ({tie}); "
                f"{self.params / 1e9:.2f} B parameters" +
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
    return ModelShape(layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], q_heads=q, kv_heads=kv,
                      head_dim=head_dim, intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                      tied=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=bias, name=name,
                      max_positions=_max_positions(cfg, name))


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
    return shape_from_config(json.loads(file.read_text()), name=p.name if p.is_dir() else p.parent.name)
