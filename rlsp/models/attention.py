"""Ulysses attention as a transformers attention function (`attn_implementation="rlsp_ulysses"`).

The model is built with this implementation name; no model code is patched. The SP context is a
forward kwarg (`model(..., sp_context=ctx)`) that transformers passes through its decoder layers to
the attention function. The function:
  1. exchanges [S tokens, all heads] for [T tokens, this rank's heads] (one fused q/k/v all-to-all),
  2. runs causal attention inside every packed segment (cu_seqlens of the context),
  3. exchanges the output back to [S tokens, all q heads] (one all-to-all).
The model's own attention mask is not built: a mask policy registered under the same name returns
None, and segment boundaries come from the context only.

Sliding-window and soft-capped layers (the layer's `sliding_window` / `softcap` kwargs, e.g. Gemma 2/3) and layers
with attention sinks (the `s_aux` kwarg, gpt-oss: sliced to this rank's q heads after the all-to-all) take
rlsp.models.window_attention's banded kernels; with a ring, ring attention (rlsp.parallel.ring) applies all three. Multi-latent attention (deepseek_v2/v3)
hands v with a narrower head dim than q/k: the exchanges carry it as is, SDPA takes it, flash_attn gets it zero-padded
(`_flash_causal`), ring attention packs it beside k in its K/V blocks. Other layers:
inner attention: `flash_attn_varlen_func` on CUDA in fp16/bf16 when flash_attn is installed;
otherwise `scaled_dot_product_attention` with `is_causal=True`: one batched call over the segments
right-padded to the longest when that costs at most 4x the exact work (many short rollouts: one
kernel instead of one per sequence; 30 % off a tiny model's backward on CPU), else one call per
segment. Both are exact, never materialise a T x T block-diagonal mask (which would not shrink with
sp) and skip the cross-segment blocks; the plan is computed once per micro-batch and cached on the context.

Legend: S local tokens, T stream length, H heads, D head dim, hq / hkv this rank's q / kv heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from rlsp.models.window_attention import (
    banded_attention,
    flash_window_kwargs,
    padded_band_attention,
    padded_max_len,
)
from rlsp.parallel.ring import ring_attention
from rlsp.parallel.ulysses import SPContext, ulysses_heads_to_seq, ulysses_qkv_to_heads

try:  # optional fast path on GPU
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except ImportError:  # pragma: no cover - depends on the installation
    _flash_varlen = None

ULYSSES_ATTN_IMPL = "rlsp_ulysses"


def _no_model_mask(*args: Any, **kwargs: Any) -> None:
    """Mask policy for rlsp_ulysses: the model builds no mask (segments come from the SP context)."""
    return None


def register_ulysses_attention() -> None:
    """Register the attention function and its mask policy with transformers (idempotent)."""
    AttentionInterface.register(ULYSSES_ATTN_IMPL, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES_ATTN_IMPL, _no_model_mask)


def _cached(ctx: SPContext, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    if key not in ctx.cache:
        ctx.cache[key] = build()
    return ctx.cache[key]


def _segment_bounds(ctx: SPContext) -> list[tuple[int, int]]:
    def build() -> list[tuple[int, int]]:
        cu = ctx.cu_seqlens.tolist()
        return [(s, e) for s, e in zip(cu[:-1], cu[1:]) if e > s]

    return _cached(ctx, ("segments",), build)


def _kv_plan(ctx: SPContext, device: torch.device) -> tuple[torch.Tensor, bool]:
    """(local kv head read by each local q head, whether that is the standard grouped order).

    The standard order (local q head i reads local kv head i // (hq / hkv)) lets the kernels do GQA
    natively; otherwise (a rank whose q range starts inside a GQA group, e.g. 10q/2kv at sp=4)
    kv heads are expanded to one per local q head. Cached per micro-batch: no per-layer host sync.
    """
    layout, rank = ctx.layout, ctx.ulysses_rank

    def build() -> tuple[torch.Tensor, bool]:
        (qs, qe), (ks, ke) = layout.q_ranges[rank], layout.kv_ranges[rank]
        index = [h // layout.group_size - ks for h in range(qs, qe)]
        hq, hkv = qe - qs, ke - ks
        native = hkv > 0 and hq % hkv == 0 and index == [i // (hq // hkv) for i in range(hq)]
        return torch.tensor(index, dtype=torch.int64, device=device), native

    return _cached(ctx, ("kv_plan", str(device)), build)


def _padded_plan(ctx: SPContext, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """Gather/scatter indices that lay the stream's segments out as a padded batch [N, Lmax], or None
    when padding would more than quadruple the attention work (N * Lmax^2 vs the sum of L^2).

    Segments are right-padded; under a causal mask a real query never sees the padding keys that
    follow it, so attention over the padded batch is exact for every real token. Padding rows read
    the segment's last token (finite values) and are dropped. Segments cover the stream in order, so
    the real entries of the row-major padded layout ARE the stream tokens in order.
    """
    def build() -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        bounds = _segment_bounds(ctx)
        lens = [e - s for s, e in bounds]
        n, lmax = len(lens), max(lens)
        if n < 2 or n * lmax * lmax > 4 * sum(x * x for x in lens):
            return None
        starts = torch.tensor([s for s, _ in bounds], dtype=torch.int64)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        col = torch.arange(lmax, dtype=torch.int64)
        gather = (starts[:, None] + torch.minimum(col[None, :], lens_t[:, None] - 1)).reshape(-1)
        keep = (torch.arange(n, dtype=torch.int64)[:, None] * lmax + col[None, :])[col[None, :] < lens_t[:, None]]
        return gather.to(device), keep.to(device), n, lmax

    return _cached(ctx, ("padded_plan", str(device)), build)


def _sdpa(q_NHLD: torch.Tensor, k_NHLD: torch.Tensor, v_NHLD: torch.Tensor, scale: float, dropout: float,
          gqa: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q_NHLD, k_NHLD, v_NHLD, dropout_p=dropout, is_causal=True, scale=scale,
                                          enable_gqa=gqa)


def _segmented_sdpa(
    q_THD: torch.Tensor,
    k_THD: torch.Tensor,
    v_THD: torch.Tensor,
    ctx: SPContext,
    scale: float,
    dropout: float,
    gqa: bool,
) -> torch.Tensor:
    """Causal SDPA inside each segment: one batched call over the segments padded to the longest
    when that costs at most 4x the work (many short sequences: one kernel instead of one per
    sequence), else one call per segment (a long sequence among short ones: no quadratic padding)."""
    plan = _padded_plan(ctx, q_THD.device)
    if plan is not None:
        gather, keep, n, lmax = plan
        # [T, H, D] -> [N, H, Lmax, D]; the fused SDPA kernels want 4-D inputs (with 3-D inputs CPU
        # falls back to the math kernel, which stores the [H, L, L] attention weights)
        q, k, v = (x.index_select(0, gather).view(n, lmax, x.shape[1], x.shape[2]).transpose(1, 2)
                   for x in (q_THD, k_THD, v_THD))
        o_NLHD = _sdpa(q, k, v, scale, dropout, gqa).transpose(1, 2)
        return o_NLHD.reshape(n * lmax, q_THD.shape[1], v_THD.shape[2]).index_select(0, keep)
    outputs = []
    for start, end in _segment_bounds(ctx):
        q_1HLD, k_1HLD, v_1HLD = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q_THD, k_THD, v_THD))
        outputs.append(_sdpa(q_1HLD, k_1HLD, v_1HLD, scale, dropout, gqa)[0].transpose(0, 1))
    return torch.cat(outputs, dim=0)


def _use_flash(q_THD: torch.Tensor) -> bool:
    return _flash_varlen is not None and q_THD.is_cuda and q_THD.dtype in (torch.float16, torch.bfloat16)


def _ring(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, ctx: SPContext, scale: float,
          dropout: float, window: int | None = None, softcap: float | None = None,
          sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """Ring attention over the stream for this rank's heads (windows, soft-caps, sinks too) -> [Tr, hq, D]."""
    if dropout > 0.0:
        raise ValueError(f"attention dropout={dropout} is not supported with ring sequence parallelism; set the "
                         "model's attention_dropout to 0 or ring_sequence_parallel_size=1")
    kv_index, native = _kv_plan(ctx, q_THD.device)
    return ring_attention(q_THD, k_THD, v_THD, ctx.ring, scale, None if native else kv_index, stats=ctx.stats,
                          window=window, softcap=softcap, sinks_H=sinks_H)


def _windowed(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, ctx: SPContext, scale: float,
              dropout: float, window: int | None, softcap: float | None,
              sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """A sliding-window, soft-capped and/or sink layer (rlsp.models.window_attention); kv heads expanded to q heads."""
    if ctx.ring is not None:  # ring attention applies the window and the cap per block, the sinks after its merge
        return _ring(q_THD, k_THD, v_THD, ctx, scale, dropout, window, softcap, sinks_H)
    kv_index, _ = _kv_plan(ctx, q_THD.device)
    k_THD, v_THD = k_THD.index_select(1, kv_index), v_THD.index_select(1, kv_index)
    if sinks_H is None and _use_flash(q_THD):  # flash_attn's varlen function has no sinks
        cu = _cached(ctx, ("cu_seqlens", str(q_THD.device)), lambda: ctx.cu_seqlens.to(q_THD.device))
        return _flash_varlen(q_THD, k_THD, v_THD, cu, cu, ctx.max_seqlen, ctx.max_seqlen, dropout_p=dropout,
                             softmax_scale=scale, causal=True, **flash_window_kwargs(window, softcap))
    plan = _padded_plan(ctx, q_THD.device)
    if plan is not None and plan[3] <= padded_max_len():  # many short segments: one call
        gather, keep, n, lmax = plan
        q, k, v = (x.index_select(0, gather).view(n, lmax, x.shape[1], x.shape[2]).transpose(1, 2)
                   for x in (q_THD, k_THD, v_THD))
        o_NLHD = padded_band_attention(q, k, v, scale, window, softcap, dropout, sinks_H).transpose(1, 2)
        return o_NLHD.reshape(n * lmax, q_THD.shape[1], v_THD.shape[2]).index_select(0, keep)
    return banded_attention(q_THD, k_THD, v_THD, _segment_bounds(ctx), scale, window, softcap, dropout, sinks_H)


def _flash_causal(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, ctx: SPContext, scale: float,
                  dropout: float) -> torch.Tensor:
    """flash_attn_varlen_func over the stream's segments. flash_attn wants one head dim for q, k and v: a
    narrower v (multi-latent attention, Dv < Dq) is zero-padded to Dq and the output sliced back to Dv; the
    padded columns of softmax(QK^T) V are zero and the kept ones unchanged, so this is exact."""
    cu = _cached(ctx, ("cu_seqlens", str(q_THD.device)), lambda: ctx.cu_seqlens.to(q_THD.device))
    dq, dv = q_THD.shape[2], v_THD.shape[2]
    if dv > dq:
        raise ValueError(f"value head dim {dv} > query/key head dim {dq}: flash_attn needs one head dim; "
                         "legal: v_head_dim <= qk head dim (or run without flash_attn: SDPA)")
    if dv < dq:
        v_THD = F.pad(v_THD, (0, dq - dv))
    o_THD = _flash_varlen(q_THD, k_THD, v_THD, cu, cu, ctx.max_seqlen, ctx.max_seqlen, dropout_p=dropout,
                          softmax_scale=scale, causal=True)
    return o_THD[..., :dv] if dv < dq else o_THD


def _local_attention(
    q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, ctx: SPContext, scale: float, dropout: float,
    window: int | None = None, softcap: float | None = None, sinks_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each segment of the stream for this rank's heads -> [Tr, hq, D]
    (the whole stream without a ring; with one, ring attention over its ranks)."""
    hq, hkv = q_THD.shape[1], k_THD.shape[1]
    if hq == 0:
        # A rank without heads (q heads < ulysses) still returns a graph-connected empty output so
        # that its backward all-to-all runs in step with the other ranks. Every rank of its ring
        # group has the same (empty) heads, so the ring is skipped by all of them. v's head dim: the
        # output's on every rank (multi-latent attention: Dv != Dq).
        return v_THD * 0.0
    if window is not None or softcap is not None or sinks_H is not None:
        return _windowed(q_THD, k_THD, v_THD, ctx, scale, dropout, window, softcap, sinks_H)
    if ctx.ring is not None:
        return _ring(q_THD, k_THD, v_THD, ctx, scale, dropout)
    kv_index, native = _kv_plan(ctx, q_THD.device)
    if not native:
        k_THD, v_THD = k_THD.index_select(1, kv_index), v_THD.index_select(1, kv_index)
        hkv = hq
    if _use_flash(q_THD):
        return _flash_causal(q_THD, k_THD, v_THD, ctx, scale, dropout)
    return _segmented_sdpa(q_THD, k_THD, v_THD, ctx, scale, dropout, gqa=hq != hkv)


def _check_call(module: torch.nn.Module, query: torch.Tensor, sp_context: Any,
                kwargs: dict[str, Any]) -> tuple[SPContext, int | None, float | None]:
    """(the SP context, the layer's sliding window or None, its attention soft-cap or None); sinks: `_rank_sinks`."""
    if not isinstance(sp_context, SPContext):
        raise RuntimeError(
            f"attn_implementation={ULYSSES_ATTN_IMPL!r} needs the forward kwarg sp_context=SPContext "
            f"(got {type(sp_context).__name__}); build one with rlsp.parallel.ulysses.build_sp_context and "
            "call model(input_ids=..., position_ids=..., sp_context=ctx), or load the model with "
            "attn_implementation='sdpa' for use without sequence parallelism (e.g. generation)"
        )
    # transformers passes the layer's window as a kwarg (None on full layers); the module attribute is the
    # fallback for families that set it there only
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"query has shape {tuple(query.shape)}; expected [1, H, S, D] (one packed stream)")
    return sp_context, window, kwargs.get("softcap")


def _rank_sinks(module: torch.nn.Module, ctx: SPContext, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """This rank's q heads' slice of the layer's attention sinks (the `s_aux` kwarg, else `module.sinks`; one logit
    per q head), or None; slicing keeps the autograd path to the full parameter."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    if sinks is None:
        return None
    if hasattr(sinks, "to_local"):  # tensor parallel: a DTensor Shard(0), this tp rank's q heads' sinks
        sinks = sinks.to_local()
    layout = ctx.layout
    if tuple(sinks.shape) != (layout.num_q_heads,):
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: attention sinks of shape {tuple(sinks.shape)}; "
                         f"{ULYSSES_ATTN_IMPL} applies one sink per q head, shape ({layout.num_q_heads},)")
    start, end = layout.q_ranges[ctx.ulysses_rank]
    return sinks[start:end]


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sp_context: SPContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query/key [1, Hq|Hkv, S, D], value [1, Hkv, S, Dv] -> ([1, S, Hq, Dv], None)
    (Dv == D except for multi-latent attention, e.g. deepseek_v3).

    `attention_mask` is ignored (the mask policy makes it None); segments come from `sp_context`.
    """
    ctx, window, softcap = _check_call(module, query, sp_context, kwargs)
    sinks_H = _rank_sinks(module, ctx, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_THD, k_THD, v_THD = ulysses_qkv_to_heads(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), ctx
    )
    o_THD = _local_attention(q_THD, k_THD, v_THD, ctx, scale, dropout, window, softcap, sinks_H)
    o_SHD = ulysses_heads_to_seq(o_THD, ctx)
    ctx.stats.attn_calls += 1
    return o_SHD.unsqueeze(0), None
