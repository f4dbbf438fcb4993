"""Packed causal attention with a per-layer sliding window and/or attention-logit soft-capping.

The layers of Gemma 2 / Gemma 3 (and any family whose `config.layer_types` mixes 'full_attention' and
'sliding_attention') reach rlsp_ulysses with the layer's `sliding_window` and `softcap`; after the
Ulysses all-to-all this rank holds the whole packed stream for its heads, so the window applies to it
directly, inside each packed segment.

Window convention (transformers' `sliding_window_overlay`): query i sees key j of its own segment when
i - window < j <= i, i.e. the query itself and the window - 1 keys before it. Soft-capping maps every
score s to cap * tanh(s / cap) before the mask and the softmax (Gemma 2's eager attention).

Kernels:
- CUDA fp16/bf16 with flash_attn installed: `flash_attn_varlen_func` with `window_size=(window - 1, 0)`
  and `softcap` (its own definitions match the two above);
- otherwise query chunks of at most `_CHUNK` rows against their key band only (the segment's keys from
  max(segment start, first query - window + 1) to the last query): SDPA with a boolean band mask
  when there is no soft-capping, an explicit softmax (in at least fp32) when there is (SDPA cannot cap). No T x T mask
  is built; the work and the memory kept for backward are O(T * (window + chunk)) on windowed layers.

Legend: T stream length, H this rank's q heads (kv heads expanded to them), D head dim, C query rows of a
chunk, K keys of its band.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_CHUNK = 256  # query rows per block: bounds a block's [H, C, K] scores


def _attend_block(q_HCD: torch.Tensor, k_HKD: torch.Tensor, v_HKD: torch.Tensor, keep_CK: torch.Tensor,
                  scale: float, softcap: float | None, dropout: float) -> torch.Tensor:
    """One query block against its key band -> [H, C, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q_HCD[None], k_HKD[None], v_HKD[None], attn_mask=keep_CK,
                                              dropout_p=dropout, scale=scale)[0]
    scores_HCK = torch.matmul(q_HCD, k_HKD.transpose(1, 2)) * scale
    scores_HCK = torch.tanh(scores_HCK / softcap) * softcap
    scores_HCK = scores_HCK.masked_fill(~keep_CK, float("-inf"))
    probs_HCK = torch.softmax(scores_HCK, dim=-1, dtype=torch.promote_types(q_HCD.dtype, torch.float32))
    probs_HCK = probs_HCK.to(q_HCD.dtype)
    if dropout > 0.0:
        probs_HCK = F.dropout(probs_HCK, p=dropout)
    return torch.matmul(probs_HCK, v_HKD)


def banded_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
                     bounds: list[tuple[int, int]], scale: float, window: int | None, softcap: float | None,
                     dropout: float = 0.0, chunk: int | None = None) -> torch.Tensor:
    """Causal attention inside each segment [start, end) of `bounds`, limited to `window` keys per query
    (None: the whole causal prefix) with optional soft-capping; q, k, v with the same heads -> [T, H, D]."""
    outputs, chunk = [], chunk or _CHUNK
    device = q_THD.device
    for start, end in bounds:
        for a in range(start, end, chunk):
            b = min(a + chunk, end)
            lo = start if window is None else max(start, a - window + 1)
            i_C1 = torch.arange(a, b, device=device)[:, None]
            j_1K = torch.arange(lo, b, device=device)[None, :]
            keep_CK = j_1K <= i_C1
            if window is not None:
                keep_CK &= j_1K > i_C1 - window
            q_HCD, k_HKD, v_HKD = (x.transpose(0, 1) for x in (q_THD[a:b], k_THD[lo:b], v_THD[lo:b]))
            outputs.append(_attend_block(q_HCD, k_HKD, v_HKD, keep_CK, scale, softcap, dropout).transpose(0, 1))
    return torch.cat(outputs, dim=0)


def flash_window_kwargs(window: int | None, softcap: float | None) -> dict[str, object]:
    """flash_attn_varlen_func's arguments for this layer's window and soft-capping (causal is passed apart)."""
    return {"window_size": (-1, -1) if window is None else (window - 1, 0),
            "softcap": 0.0 if softcap is None else float(softcap)}
