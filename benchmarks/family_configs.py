"""The model families of benchmarks/gpu_families.py: transformers' own config classes at a "mid" shape (CUDA: the
family's real head dims and widths, 4 layers, a 32k vocabulary, few experts, shortened windows) and a small one (CPU).

Imported by the script (not a script itself); family_config() refuses an unknown family by name.
"""

from __future__ import annotations

from transformers import (
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    Qwen2_5_VLConfig,
    Qwen3NextConfig,
)

FAMILIES = ("gemma2", "gemma3", "gpt_oss", "deepseek_v3", "qwen3_next", "qwen2_5_vl")
MID = dict(vocab_size=32000, num_hidden_layers=4, initializer_range=0.02)
SMALL = dict(vocab_size=512, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, initializer_range=0.05)
SLIDE4 = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_ROPE_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
              "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def _mid_shape(family: str) -> dict:
    """The family's real head dims and widths (Gemma 2 2B, Gemma 3 4B, gpt-oss 20B, DeepSeek-V3 narrowed to
    hidden 2048, Qwen3-Next 80B-A3B, Qwen2.5-VL 3B) with shorter windows and few experts."""
    return {
        "gemma2": dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=256, query_pre_attn_scalar=256, sliding_window=1024),
        "gemma3": dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=256, query_pre_attn_scalar=256, sliding_window=512),
        "gpt_oss": dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, sliding_window=128, num_local_experts=4, num_experts_per_tok=2),
        "deepseek_v3": dict(hidden_size=2048, intermediate_size=8192, moe_intermediate_size=1024,
                            num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512,
                            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8,
                            num_experts_per_tok=2),
        "qwen3_next": dict(hidden_size=2048, intermediate_size=5120, num_attention_heads=16, num_key_value_heads=2,
                           head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                           linear_value_head_dim=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
                           shared_expert_intermediate_size=512),
        "qwen2_5_vl": dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2),
    }[family]


def _small_shape(family: str) -> dict:
    extra = {"gemma2": dict(sliding_window=16), "gemma3": dict(sliding_window=16),
             "gpt_oss": dict(sliding_window=16, num_local_experts=4, num_experts_per_tok=2),
             "deepseek_v3": dict(num_key_value_heads=4, head_dim=8, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16,
                                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                                 num_experts_per_tok=2),
             "qwen3_next": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, shared_expert_intermediate_size=32),
             "qwen2_5_vl": {}}
    return {**SMALL, **extra[family]}


def family_config(family: str, small: bool):
    """transformers' config of `family` at the mid (CUDA) or small (CPU) shape."""
    shape = {**MID, **(_small_shape(family) if small else _mid_shape(family))}
    layers = shape["num_hidden_layers"]
    if family == "gemma2":
        return Gemma2Config(**shape, layer_types=SLIDE4[:layers], attn_logit_softcapping=50.0,
                            final_logit_softcapping=30.0)
    if family == "gemma3":
        return Gemma3TextConfig(**shape, layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    if family == "gpt_oss":
        return GptOssConfig(**shape, layer_types=SLIDE4[:layers], tie_word_embeddings=False)
    if family == "deepseek_v3":
        return DeepseekV3Config(**shape, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                routed_scaling_factor=2.5, rope_parameters=dict(_ROPE_YARN))
    if family == "qwen3_next":
        return Qwen3NextConfig(**shape, linear_conv_kernel_dim=4, decoder_sparse_step=1,
                               layer_types=["linear_attention"] * (layers - 1) + ["full_attention"])
    if family == "qwen2_5_vl":
        vocab = shape["vocab_size"]
        text = {**shape, "bos_token_id": None, "eos_token_id": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                             "mrope_section": [2, 3, 3] if small else [16, 24, 24]}}
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=shape["hidden_size"],
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=vocab - 4,
                                video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
                                vision_end_token_id=vocab - 1, tie_word_embeddings=False)
    raise ValueError(f"family={family!r}; legal: {FAMILIES}")
