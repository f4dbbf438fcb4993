"""Tiny DeepSeek-V3 / DeepSeek-V2 configs and model directories for rlsp's multi-latent attention (MLA) tests.

Built from transformers' own config classes. DeepSeek-V3: 3 layers, the first dense (first_k_dense_replace=1), the
others routed MoE (8 experts in 2 groups, topk_group=1, 2 experts per token, one shared expert); q through a
low-rank projection (q_lora_rank=12) or directly (`q_lora_rank=None`), kv_lora_rank=10; the head dims all differ:
qk_nope 6 + qk_rope 4 = 10 for q/k, 6 for v; 6 heads (Ulysses 4 splits them unevenly: 2+2+1+1); yarn rope scaling
with mscale_all_dim, so transformers' `scaling` is not head_dim^-0.5. DeepSeek-V2: the same attention shapes with
its greedy router.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

HEADS = 6
VARIANTS = ("v3", "v3_no_q_lora", "v2")
_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def deepseek_config(variant: str = "v3", vocab: int = 50, **extra) -> DeepseekV3Config | DeepseekV2Config:
    """The tiny config of `variant` (one of VARIANTS); `extra` overrides entries."""
    common = dict(vocab_size=vocab, hidden_size=36, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
                  n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=12,
                  kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64,
                  rope_parameters=dict(_ROPE), initializer_range=0.2)
    if variant == "v2":
        common.update(topk_method="greedy")
        common.update(extra)
        return DeepseekV2Config(**common)
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; legal: {VARIANTS}")
    common.update(n_group=2, topk_group=1, routed_scaling_factor=2.5)
    if variant == "v3_no_q_lora":
        common.update(q_lora_rank=None)
    common.update(extra)
    return DeepseekV3Config(**common)


def write_tiny_deepseek(variant: str, out_dir: str, **shape) -> str:
    """A loadable model directory (fp32 weights, rlsp's char tokenizer) of the tiny `variant` model (`shape`
    overrides config entries)."""
    from rlsp.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = deepseek_config(variant, vocab=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                             eos_token_id=None, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a nonzero routing bias (it is trained outside autograd, zero at init): it must be kept
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.1)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
