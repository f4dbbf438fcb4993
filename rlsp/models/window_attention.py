"""Packed causal attention with a per-layer sliding window, attention-logit soft-capping and/or attention sinks.

The layers of Gemma 2 / Gemma 3 (and any family whose `config.layer_types` mixes 'full_attention' and
'sliding_attention') reach rlsp_ulysses with the layer's `sliding_window` and `softcap`; after the
Ulysses all-to-all this rank holds the whole packed stream for its heads, so the window applies to it
directly, inside each packed segment.

Window convention (transformers' `sliding_window_overlay`): query i sees key j of its own segment when
i - window < j <= i, i.e. the query itself and the window - 1 keys before it. Soft-capping maps every
score s to cap * tanh(s / cap) before the mask and the softmax (Gemma 2's eager attention). Attention sinks
(gpt-oss: one learned logit per q head) join the softmax's denominator only, p_j = exp(s_j) / (sum_k exp(s_k) +
exp(sink)): a column of the sink's value appended to the scores and dropped after the softmax (gpt-oss's eager
attention); the gradient reaches the sinks through it.

Kernels:
- CUDA fp16/bf16 with flash_attn installed: `flash_attn_varlen_func` with `window_size=(window - 1, 0)`
  and `softcap` (its own definitions match the two above);
- otherwise, when every segment is at most `_CHUNK` tokens and padding them to the longest costs at most
  4x (rlsp.models.attention's padded plan: many short rollouts), one call over the padded segments with an
  [L, L] band mask; else query chunks of at most `_CHUNK` rows against their key band only (the segment's
  keys from max(segment start, first query - window + 1) to the last query). Both run SDPA with a boolean
  mask without soft-capping and sinks, and an explicit softmax (in at least fp32) with either (SDPA can neither
  cap nor add a sink; its log-sum-exp, which would give out * sigmoid(lse - sink), carries no gradient on CPU).
  No T x T mask is built; on windowed layers the chunked path's work and the memory it keeps for backward are
  O(T * (window + chunk)); on soft-capped or sink layers the chunked path recomputes each block's scores in
  backward (activation checkpointing per block) instead of keeping O(T^2 / 2) of them on a full layer.
  flash_attn's varlen function has no sinks: rlsp.models.attention takes this torch path for sink layers on
  CUDA too.

Legend: N padded segments, L their length, T stream length, H this rank's q heads (kv heads expanded to them), D head dim, C query rows of a
chunk, K keys of its band; sinks_H this rank's slice of the layer's sinks (None: no sinks)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

_CHUNK = 256  # query rows per block: bounds a block's [H, C, K] scores


def _attend_block(q_NHCD: torch.Tensor, k_NHKD: torch.Tensor, v_NHKD: torch.Tensor, keep_CK: torch.Tensor,
                  scale: float, softcap: float | None, dropout: float,
                  sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """Query blocks against their keys under the [C, K] mask `keep_CK` -> [N, H, C, D] (4-D inputs: with 3-D ones
    CPU's SDPA falls back to its math kernel)."""
    if softcap is None and sinks_H is None:
        return F.scaled_dot_product_attention(q_NHCD, k_NHKD, v_NHKD, attn_mask=keep_CK, dropout_p=dropout,
                                              scale=scale)
    work = torch.promote_types(q_NHCD.dtype, torch.float32)
    scores_NHCK = torch.matmul(q_NHCD, k_NHKD.transpose(-1, -2)) * scale
    if softcap is not None:
        scores_NHCK = torch.tanh(scores_NHCK / softcap) * softcap
    scores_NHCK = scores_NHCK.to(work).masked_fill(~keep_CK, float("-inf"))
    if sinks_H is None:
        probs_NHCK = torch.softmax(scores_NHCK, dim=-1)
    else:  # the sink joins the denominator only: one more column, dropped after the softmax
        n, h, c, _ = scores_NHCK.shape
        sink_NHC1 = sinks_H.to(work)[None, :, None, None].expand(n, h, c, 1)
        probs_NHCK = torch.softmax(torch.cat([scores_NHCK, sink_NHC1], dim=-1), dim=-1)[..., :-1]
    probs_NHCK = probs_NHCK.to(q_NHCD.dtype)
    if dropout > 0.0:
        probs_NHCK = F.dropout(probs_NHCK, p=dropout)
    return torch.matmul(probs_NHCK, v_NHKD)


def _band(first_q: int, end: int, first_k: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[C, K] mask of queries first_q..end-1 over keys first_k..end-1: causal, within `window` when set."""
    i_C1 = torch.arange(first_q, end, device=device)[:, None]
    j_1K = torch.arange(first_k, end, device=device)[None, :]
    keep_CK = j_1K <= i_C1
    if window is not None:
        keep_CK &= j_1K > i_C1 - window
    return keep_CK


def padded_band_attention(q_NHLD: torch.Tensor, k_NHLD: torch.Tensor, v_NHLD: torch.Tensor, scale: float,
                          window: int | None, softcap: float | None, dropout: float = 0.0,
                          sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """Short segments right-padded to one length L: one call with the [L, L] causal band. A real query never
    sees the padding keys after it, so every real token's output is exact -> [N, H, L, D]."""
    keep_LL = _band(0, q_NHLD.shape[-2], 0, window, q_NHLD.device)
    return _attend_block(q_NHLD, k_NHLD, v_NHLD, keep_LL, scale, softcap, dropout, sinks_H)


def padded_max_len() -> int:
    """Longest segment the padded path takes (its [L, L] band); longer ones go through `banded_attention`."""
    return _CHUNK


def banded_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
                     bounds: list[tuple[int, int]], scale: float, window: int | None, softcap: float | None,
                     dropout: float = 0.0, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention inside each segment [start, end) of `bounds`, limited to `window` keys per query
    (None: the whole causal prefix) with optional soft-capping and sinks; q, k, v with the same heads -> [T, H, D]."""
    outputs, attend = [], _attend_block
    if (softcap is not None or sinks_H is not None) and torch.is_grad_enabled():
        # the explicit path would keep each block's [H, C, K] scores and probabilities for backward (O(T^2 / 2) on
        # a full layer): recompute them per block in backward instead
        attend = functools.partial(checkpoint, _attend_block, use_reentrant=False)
    for start, end in bounds:
        for a in range(start, end, _CHUNK):
            b = min(a + _CHUNK, end)
            lo = start if window is None else max(start, a - window + 1)
            keep_CK = _band(a, b, lo, window, q_THD.device)
            q, k, v = (x.transpose(0, 1)[None] for x in (q_THD[a:b], k_THD[lo:b], v_THD[lo:b]))
            outputs.append(attend(q, k, v, keep_CK, scale, softcap, dropout, sinks_H)[0].transpose(0, 1))
    return torch.cat(outputs, dim=0)


def flash_window_kwargs(window: int | None, softcap: float | None) -> dict[str, object]:
    """flash_attn_varlen_func's arguments for this layer's window and soft-capping (causal is passed apart)."""
    return {"window_size": (-1, -1) if window is None else (window - 1, 0),
            "softcap": 0.0 if softcap is None else float(softcap)}
