"""Tiny Qwen3.5 / Qwen3.5-MoE checkpoints in the multimodal wrapper form (model_type qwen3_5 / qwen3_5_moe) for
rlsp's text-only tests of them.

The text model is tests/tiny_linear.py's (Gated DeltaNet layers around one gated full-attention layer; the MoE one
with 3 tiny experts plus a shared expert), conditioned the same way (initializer_range 0.08, decay rates A in
[0.3, 3]); the vision tower is one tiny block. Saved through transformers' Qwen3_5ForConditionalGeneration /
Qwen3_5MoeForConditionalGeneration, so the weights carry the real checkpoints' names (`model.language_model.*`,
`model.visual.*`, `lm_head.weight`) and config.json holds text_config + vision_config.
"""

from __future__ import annotations

import torch
from tiny_linear import linear_config

WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # wrapper -> its text family
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
              temporal_patch_size=1, spatial_merge_size=1)


def wrapper_model(family: str, **text):
    """A random-init Qwen3_5ForConditionalGeneration (or the MoE one) of the tiny text model (`text` overrides)."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    config_cls, model_cls = {"qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
                             "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)}[family]
    text_config = linear_config(WRAPPERS[family], **{"initializer_range": 0.08, **text}).to_dict()
    config = config_cls(text_config=text_config, vision_config=dict(VISION))
    torch.manual_seed(0)
    model = model_cls(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                param.copy_(torch.linspace(0.3, 3.0, param.numel()).log())
    return model


def write_tiny_qwen3_5(family: str, out_dir: str) -> str:
    """A loadable wrapper checkpoint directory (fp32 weights, rlsp's char tokenizer) of `family` (qwen3_5 or
    qwen3_5_moe)."""
    from rlsp.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = wrapper_model(family, vocab=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                          eos_token_id=None)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def write_text_config(path: str, out_dir: str) -> str:
    """The text model's config.json alone (what tests/tolerances.py reads to size its bounds) in `out_dir`."""
    from transformers import AutoConfig

    AutoConfig.from_pretrained(path).text_config.save_pretrained(out_dir)
    return out_dir
