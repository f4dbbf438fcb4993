"""Tiny Gemma 2 / Gemma 3 (text) configs and model directories for rlsp's windowed-attention tests.

Built from transformers' own config classes: 3 layers mixing sliding and full attention, window 4 (shorter
than the test rows, so the window matters), 6 q / 2 kv heads (Ulysses 4 does not divide them); Gemma 2 with
attention and final-logit soft-capping.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

FAMILIES = ("gemma2", "gemma3_text")
HEADS = (6, 2)
WINDOW = 4


def gemma_config(family: str, vocab: int = 50, **extra) -> Gemma2Config | Gemma3TextConfig:
    common = dict(vocab_size=vocab, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=HEADS[0], num_key_value_heads=HEADS[1], head_dim=8, sliding_window=WINDOW,
                  initializer_range=0.2)
    common.update(extra)  # e.g. head_dim=64 for vLLM's CPU kernels
    if family == "gemma2":
        return Gemma2Config(**common, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if family == "gemma3_text":
        return Gemma3TextConfig(**common, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    raise ValueError(f"family={family!r}; legal: {FAMILIES}")


def write_tiny_gemma(family: str, out_dir: str, **shape) -> str:
    """A loadable model directory (fp32 weights, rlsp's char tokenizer) of the tiny `family` model (`shape`
    overrides config entries)."""
    from rlsp.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = gemma_config(family, vocab=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                          eos_token_id=None, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
