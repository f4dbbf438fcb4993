"""Tiny mixture-of-experts configs (transformers' own config classes) for rlsp's MoE weight-sync tests.

Head size 32 and expert width 32 are what vLLM 0.32's CPU kernels take (rlsp.config.choices.VLLM_CPU_HEAD_DIMS; its
CPU MoE experts pad widths that are not multiples of 32, see rlsp.rollout.support.check_cpu_moe_width); 2 layers,
4 experts, 2 per token. Router weights, experts and attention are all random (initializer_range 0.2), so perturbing
any one of them moves the logprobs.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Glm4MoeConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

# per family: its config class and the entries that shape its experts
FAMILY_SHAPES = {
    "qwen3_moe": (Qwen3MoeConfig, dict(intermediate_size=48, moe_intermediate_size=32, num_experts=4, norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeConfig, dict(intermediate_size=48, moe_intermediate_size=32, num_experts=4,
                                       shared_expert_intermediate_size=32)),
    "mixtral": (MixtralConfig, dict(intermediate_size=32, num_local_experts=4)),
    "olmoe": (OlmoeConfig, dict(intermediate_size=32, num_experts=4)),
    "glm4_moe": (Glm4MoeConfig, dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                                     n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)),
}
MOE_FAMILIES = tuple(FAMILY_SHAPES)


def moe_config(family: str, vocab: int = 64, **extra) -> PretrainedConfig:
    """The tiny `family` config; `extra` overrides any entry (e.g. moe_intermediate_size)."""
    if family not in FAMILY_SHAPES:
        raise ValueError(f"family={family!r}; legal: {MOE_FAMILIES}")
    config_class, shape = FAMILY_SHAPES[family]
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, num_experts_per_tok=2, initializer_range=0.2, bos_token_id=None, eos_token_id=None)
    return config_class(**{**common, **shape, **extra})


def write_tiny_moe(family: str, out_dir: str, **extra) -> str:
    """A loadable model directory (fp32 weights, rlsp's char tokenizer) of the tiny `family` MoE model."""
    from rlsp.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = moe_config(family, vocab=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# The exactness matrix's shape (tests/distributed/test_moe_exact.py): 6 q / 2 kv heads (Ulysses 4 splits them
# unevenly), head size 8, and a smaller init than the weight-sync models: with initializer_range 0.2 some tokens'
# router scores sit within roundoff of a top-k tie, and a routing flip between two layouts moves a gradient by
# O(1e-2) (tests/tiny_linear.py on conditioning); `router_margin` measures how far every token sits from one.
EXACT_SHAPE = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8, initializer_range=0.05)


def write_exact_moe(family: str, out_dir: str) -> str:
    """The tiny `family` MoE model of the exactness matrix (EXACT_SHAPE), as `write_tiny_moe` writes it."""
    return write_tiny_moe(family, out_dir, **EXACT_SHAPE)


def router_margin(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[float, float]:
    """(smallest gap between the k-th and (k+1)-th router logit over the real tokens of every MoE layer, largest
    |router logit|) of transformers' own forward. Every family here ranks experts by a monotone function of its
    logits (softmax, or glm4_moe's sigmoid with a zero correction bias and one group), so the gap in logits is the
    distance to a routing flip."""
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
    k = model.config.num_experts_per_tok
    real = attention_mask.reshape(-1).bool()
    gaps, scale = [], 0.0
    for logits_NE in out.router_logits:
        logits_NE = logits_NE.float()[real]
        top_NK = logits_NE.topk(k + 1, dim=-1).values
        gaps.append(float((top_NK[:, k - 1] - top_NK[:, k]).min()))
        scale = max(scale, float(logits_NE.abs().max()))
    return min(gaps), scale
