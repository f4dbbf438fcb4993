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
