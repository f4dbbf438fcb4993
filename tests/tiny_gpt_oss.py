"""Tiny gpt-oss config and model directory for rlsp's attention-sink tests.

Built from transformers' own GptOssConfig: 3 layers mixing sliding and full attention, window 4 (shorter than the
test rows, so the window matters), 6 q / 2 kv heads (Ulysses 4 does not divide them), 4 tiny experts with 2 per
token (clamped SwiGLU, router bias), an untied output layer. transformers initialises the attention sinks with
N(0, initializer_range): at 0.2 they differ per head and from 0, and a sink always adds exp(sink) to the softmax's
denominator, so a kernel that dropped or misplaced them would move every logprob.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GptOssConfig

HEADS = (6, 2)
WINDOW = 4


def gpt_oss_config(vocab: int = 50, **extra) -> GptOssConfig:
    """The tiny config; `extra` overrides entries (e.g. head_dim=64 for vLLM's CPU kernels)."""
    common = dict(vocab_size=vocab, hidden_size=48, intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=HEADS[0], num_key_value_heads=HEADS[1], head_dim=8, sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_local_experts=4,
                  num_experts_per_tok=2, initializer_range=0.2, max_position_embeddings=4096,
                  tie_word_embeddings=False)
    common.update(extra)
    return GptOssConfig(**common)


def write_tiny_gpt_oss(out_dir: str, **shape) -> str:
    """A loadable model directory (fp32 weights, rlsp's char tokenizer) of the tiny model (`shape` overrides config
    entries)."""
    from rlsp.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = gpt_oss_config(vocab=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                            eos_token_id=None, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
