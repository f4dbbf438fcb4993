"""Tiny Qwen3-Next and Qwen3.5 (text) configs and model directories for rlsp's linear-attention tests.

Built from transformers' own config classes: 3 layers, Gated DeltaNet (linear_attention) layers around one gated
full-attention layer (q projection doubled with an output gate, partial rotary), 2 linear key heads read by 4 value
heads (each key head by a group of 2), conv kernel 4; full attention 4 q / 2 kv heads. Qwen3-Next and Qwen3.5-MoE
(text) with a sparse MoE of 3 tiny experts (2 per token) plus a shared expert.

Conditioning: the distributed tests compare gradients across layouts within tests/tolerances.py's roundoff bounds,
which assume a well-conditioned model. transformers' default init draws each value head's decay rate A from
U(0.01, 16): a head with A near 16 forgets its state within a token, and its A_log / dt_bias gradients become sums of
roundoff-sized terms; with initializer_range 0.2 the MoE router also sits near top-k ties. Perturbing every weight
by one ulp (relative 1e-7) then moved gradients by up to 1e-4 (1e-2 after a routing flip), beyond any layout bound.
`write_tiny_linear` therefore uses initializer_range 0.08 and decay rates A in [0.3, 3]: the same perturbation moves
every gradient by < 1e-5 (measured), below the bound.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
HEADS = (4, 2)  # full-attention q / kv heads
LINEAR_HEADS = (2, 4)  # linear_num_key_heads / linear_num_value_heads
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention"]


def linear_config(family: str, vocab: int = 50, **extra) -> Qwen3NextConfig | Qwen3_5TextConfig:
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=len(LAYER_TYPES),
                  num_attention_heads=HEADS[0], num_key_value_heads=HEADS[1], head_dim=16,
                  linear_num_key_heads=LINEAR_HEADS[0], linear_num_value_heads=LINEAR_HEADS[1],
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  layer_types=list(LAYER_TYPES), initializer_range=0.2)
    common.update(extra)
    if family == "qwen3_next":
        return Qwen3NextConfig(**{"num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 16, **common},
                               shared_expert_intermediate_size=16, decoder_sparse_step=1)
    if family == "qwen3_5_text":
        return Qwen3_5TextConfig(**common)
    if family == "qwen3_5_moe_text":
        return Qwen3_5MoeTextConfig(**{"num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 16, **common},
                                    shared_expert_intermediate_size=16)
    raise ValueError(f"family={family!r}; legal: {FAMILIES}")


def write_tiny_linear(family: str, out_dir: str, **shape) -> str:
    """A loadable model directory (fp32 weights, rlsp's char tokenizer) of the tiny `family` model (`shape`
    overrides config entries)."""
    from rlsp.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    shape = {"initializer_range": 0.08, **shape}
    config = linear_config(family, vocab=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                           eos_token_id=None, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                param.copy_(torch.linspace(0.3, 3.0, param.numel()).log())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
