"""A lean decoding forward for the Llama family (Llama, Qwen2, Mistral) inside the hf rollout engine.

Decoding a small model on CPU is per-op overhead: transformers' forward of a 2-layer model issues
~100 small ops and as many module calls per token. This forward runs the same arithmetic with the
model's own parameters in about half the ops: q/k/v and gate/up are one GEMM each (the HF parameters
become views of one fused weight, so `update_weights`' in-place copies land in it), rotary embedding
is one table built by the model's own rotary module and applied to q and k together, the KV cache is
preallocated (one slot per token of the call, written in place), attention is torch's SDPA with
grouped KV heads, and the RMSNorms are torch's fused `rms_norm`. Equal to the model's forward up to
floating-point reassociation (tests/unit/test_lean_decoder.py compares logits and greedy tokens).

Used for the model types and settings it reproduces exactly (`unsupported_reason` returns None);
anything else (another architecture, sliding-window layers, length-dependent RoPE, MLP biases)
decodes with the model's own forward.

Legend: N rows, T tokens of this call, S cache slots, H query heads, K KV heads, D head dim, E hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the lean forward cannot reproduce `model` (None: it can)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in LENGTH_DEPENDENT_ROPE:
        return f"rope_type {rope['rope_type']!r} depends on the sequence length"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return f"pretraining_tp={cfg.pretraining_tp}"
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "sliding_window", None) is not None:
            return f"layer {i} uses sliding-window attention"
        if len({attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None}) != 1:
            return f"layer {i}: q/k/v biases differ in presence"
        if any(p.bias is not None for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return f"layer {i}: MLP biases"
    if getattr(model.lm_head, "bias", None) is not None:
        return "lm_head bias"
    return None


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking the linears' outputs; each linear's parameters become views of it,
    so in-place writes to them (weight sync) update the fused tensors too."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start : start + rows]
        if bias is not None:
            lin.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


class _Layer:
    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv_w, self.qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_w, _ = _fuse([mlp.gate_proj, mlp.up_proj])
        self.o_w, self.o_b, self.down_w = attn.o_proj.weight, attn.o_proj.bias, mlp.down_proj.weight
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' RMSNorm: normalize in float32, back to the input dtype, times the weight."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * y.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanDecoder:
    """Prefill and per-token steps over a preallocated KV cache; `start` begins a call."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean decoder does not reproduce this model: {reason}")
        cfg = model.config
        self.model = model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = [_Layer(layer) for layer in model.model.layers]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def start(self, rows: int, slots: int, key_valid_NS: torch.Tensor) -> None:
        """Allocate the cache for `slots` tokens per row; `key_valid_NS` is False at padding slots."""
        p = self.model.lm_head.weight
        shape = (rows, self.kv_heads, slots, self.head_dim)
        self.keys = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in self.layers]
        self.values = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in self.layers]
        positions = torch.arange(slots, device=p.device)[None]
        cos, sin = self.model.model.rotary_emb(p, positions)  # [1, S, D] in the model's dtype
        self.cos_SD, self.sin_SD = cos[0], sin[0]
        # padding slots never attend or get attended (a pad query sees itself only: no empty softmax rows)
        self.key_valid_N11S = None if bool(key_valid_NS.all()) else key_valid_NS[:, None, None, :]

    @torch.no_grad()
    def forward(self, ids_NT: torch.Tensor, positions_NT: torch.Tensor, slot: int) -> torch.Tensor:
        """Logits [N, V] of the last of the T tokens that occupy cache slots slot..slot+T-1."""
        n, t = ids_NT.shape
        h = F.embedding(ids_NT, self.model.model.embed_tokens.weight)  # [N, T, E]
        cos, sin = self.cos_SD[positions_NT][:, :, None], self.sin_SD[positions_NT][:, :, None]
        mask = self._mask(t, slot)
        qk_heads, dims = self.heads + self.kv_heads, self.head_dim
        for i, layer in enumerate(self.layers):
            qkv = F.linear(_rms(h, layer.in_norm), layer.qkv_w, layer.qkv_b).view(n, t, -1, dims)
            qk = _rotate(qkv[:, :, :qk_heads], cos, sin)
            self.keys[i][:, :, slot : slot + t] = qk[:, :, self.heads :].transpose(1, 2)
            self.values[i][:, :, slot : slot + t] = qkv[:, :, qk_heads:].transpose(1, 2)
            out = self._attend(qk[:, :, : self.heads], self.keys[i][:, :, : slot + t], self.values[i][:, :, : slot + t], mask)
            h = h + F.linear(out, layer.o_w, layer.o_b)
            gate, up = F.linear(_rms(h, layer.post_norm), layer.gate_up_w).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down_w)
        return F.linear(_rms(h[:, -1], self.model.model.norm), self.model.lm_head.weight)

    def _attend(self, q_NTHD: torch.Tensor, k_NKSD: torch.Tensor, v_NKSD: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA with grouped KV heads -> [N, T, H*D]. One new token: its G = H/K query heads per KV head
        are the "queries" of that head (no copy of K/V per query head, one small matmul per head)."""
        n, t = q_NTHD.shape[:2]
        if t == 1:
            q_NKGD = q_NTHD.view(n, self.kv_heads, -1, self.head_dim)
            return F.scaled_dot_product_attention(q_NKGD, k_NKSD, v_NKSD, attn_mask=mask).reshape(n, 1, -1)
        out = F.scaled_dot_product_attention(q_NTHD.transpose(1, 2), k_NKSD, v_NKSD, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(n, t, -1)

    def _mask(self, t: int, slot: int) -> torch.Tensor | None:
        """Boolean [N|1, 1, T, slot+T]: causal within the call's tokens, padding slots masked."""
        if t == 1:
            return None if self.key_valid_N11S is None else self.key_valid_N11S[..., : slot + 1]
        device = self.cos_SD.device
        causal_TS = torch.ones(t, slot + t, dtype=torch.bool, device=device).tril(diagonal=slot)
        if self.key_valid_N11S is None:
            return causal_TS[None, None]
        own_TS = torch.zeros_like(causal_TS)
        own_TS[:, slot:] = torch.eye(t, dtype=torch.bool, device=device)
        return (causal_TS & self.key_valid_N11S[..., : slot + t]) | own_TS
