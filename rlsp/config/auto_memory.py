"""The `auto` rule of gradient checkpointing (`*.model.enable_gradient_checkpointing`, rlsp.config.auto).

Checkpointing trades a second forward of every layer in backward for keeping only each layer's input.
It is worth it when the activations a micro-batch saves without it do not fit beside the training
state: on when

    activations(micro-batch tokens) > (rank memory - training state per rank) / 2

(the other half: the backward's working set, the vocab-chunked logprob head, the allocator's slack).
`activation_bytes` is the planner's `layer_saved_bytes` (rlsp.plan.memory) for a rank that holds
whole sequences and every head (no sequence, tensor or tiled-MLP split; HF's RMSNorm), divided by the
sequence- and tensor-parallel degrees the role runs with; tests/unit/test_auto_settings.py compares
the two. Memory unknown here: off (verl's default), said so.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.machine import GIB, Machine
from rlsp.config.model_shape import ModelShape

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, splits: int = 1) -> float:
    """Bytes the decoder layers save for backward over `tokens` tokens without checkpointing, on a rank
    of a role split `splits` ways (sequence x tensor parallel)."""
    e, h, d, q, kv = dtype_bytes, shape.hidden, shape.head_dim, shape.q_heads, shape.kv_heads
    norms = 2 * (h * (4 + e) + 4 + h * e)  # two norms: fp32 upcast, normed value, 1/rms; the normed input
    attn = (2 * q + 2 * kv) * d * e + q * 4 + q * d * e  # q, k, v, out and lse; o_proj's input
    mlp = 4 * shape.intermediate * e  # gate, up, act, product
    return shape.layers * tokens * (norms + attn + mlp) / splits


def micro_batch_tokens(section: Any, prompt_len: int, response_len: int) -> int:
    """Tokens of one training micro-batch on a rank: the token budget, or rows x the longest sequence."""
    if section.use_dynamic_bsz is True:
        return int(section.ppo_max_token_len_per_gpu)
    return int(section.ppo_micro_batch_size_per_gpu) * (prompt_len + response_len)


def checkpointing_choice(shape: ModelShape | None, why: str, machine: Machine, memory: float | None, state: float,
                         tokens: int, dtype: str, splits: int) -> tuple[bool, str]:
    """(enable_gradient_checkpointing, reason) for a role with `state` bytes per rank and `memory` bytes
    of the rank left to training (None: unknown)."""
    if shape is None or memory is None:
        return False, f"{why or machine.source}: off (verl's default)"
    saved = activation_bytes(shape, tokens, DTYPE_BYTES.get(dtype, 4), splits)
    room = (memory - state) / 2
    text = (f"{tokens} tokens a micro-batch save {saved / GIB:.2f} GiB of activations "
            f"{'>' if saved > room else '<='} half of the {max(0.0, memory - state) / GIB:.1f} GiB the training "
            "state leaves")
    return saved > room, f"{text}: {'on' if saved > room else 'off'}"
