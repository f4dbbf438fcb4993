"""Ulysses sequence parallelism: shard a packed token stream over an sp group, autograd all-to-alls.

Outside attention each sp rank holds S = T / sp consecutive tokens of the packed stream with all
heads. Attention needs whole sequences, so per layer:
  1. `ulysses_qkv_to_heads`: ONE all_to_all_single on one contiguous buffer carrying q, k and v turns
     [S, all heads] into [T, this rank's heads] (kv heads replicated only where the layout needs it);
  2. attention on the full stream for those heads (varlen, from the context's cu_seqlens);
  3. `ulysses_heads_to_seq`: ONE all_to_all_single back to [S, all q heads].
Both exchanges are autograd functions whose backward is the inverse exchange. Nothing here is
global: every function takes the `SPContext`, which carries the group, the stream metadata computed
once per micro-batch (cu_seqlens is never communicated) and per-forward counters.

Legend: T packed stream length (multiple of sp), S = T / sp local tokens, H heads, D head dim,
Hq / Hkv all query / kv heads, hq / hkv this rank's query / kv heads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlsp.data.packing import PackedBatch
from rlsp.parallel.heads import HeadLayout, plan_head_layout


@dataclass
class SPStats:
    """Counters of one forward/backward. Bytes are the send-buffer sizes handed to all_to_all_single
    (the rank's own chunk included). Seconds are host wall time around the call (exact for gloo;
    for asynchronous backends such as NCCL it measures the launch only). A backward recomputation
    under activation checkpointing counts as forward calls."""

    attn_calls: int = 0
    a2a_calls_fwd: int = 0
    a2a_bytes_fwd: int = 0
    a2a_calls_bwd: int = 0
    a2a_bytes_bwd: int = 0
    a2a_seconds: float = 0.0

    def reset(self) -> None:
        self.attn_calls = self.a2a_calls_fwd = self.a2a_bytes_fwd = 0
        self.a2a_calls_bwd = self.a2a_bytes_bwd = 0
        self.a2a_seconds = 0.0


@dataclass
class SPContext:
    """Everything attention needs about the sp group and the packed stream of one micro-batch."""

    group: dist.ProcessGroup | None
    sp_size: int
    sp_rank: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    total_len: int
    layout: HeadLayout
    stats: SPStats = field(default_factory=SPStats)
    # Per-micro-batch derived metadata (device copies of cu_seqlens, segment bounds), built lazily
    # by the first attention layer and reused by the others.
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def local_len(self) -> int:
        """S: tokens held by each rank outside attention."""
        return self.total_len // self.sp_size

    @property
    def local_slice(self) -> slice:
        """This rank's token range in the full stream."""
        return slice(self.sp_rank * self.local_len, (self.sp_rank + 1) * self.local_len)


def build_sp_context(
    group: dist.ProcessGroup | None, packed: PackedBatch, num_q_heads: int, num_kv_heads: int
) -> SPContext:
    """Context for one packed micro-batch; `group=None` means sp=1 (same code path, no collectives)."""
    sp_size = 1 if group is None else dist.get_world_size(group)
    sp_rank = 0 if group is None else dist.get_rank(group)
    total = packed.total_len
    if total % sp_size != 0:
        raise ValueError(
            f"packed stream has {total} tokens, not a multiple of sp={sp_size}; pack with pad_to_multiple={sp_size}"
        )
    return SPContext(
        group=group,
        sp_size=sp_size,
        sp_rank=sp_rank,
        cu_seqlens=packed.cu_seqlens.to(torch.int32),
        max_seqlen=packed.max_seqlen,
        total_len=total,
        layout=plan_head_layout(num_q_heads, num_kv_heads, sp_size),
    )


def shard_for_rank(x_T: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """This rank's slice [S, ...] of a full-stream tensor [T, ...] (a view)."""
    if x_T.shape[0] != ctx.total_len:
        raise ValueError(f"tensor has {x_T.shape[0]} tokens, the stream has {ctx.total_len}")
    return x_T.narrow(0, ctx.sp_rank * ctx.local_len, ctx.local_len)


def _exchange(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], ctx: SPContext, backward: bool
) -> torch.Tensor:
    recv = send.new_empty(sum(recv_splits))
    start = time.perf_counter()
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=ctx.group)
    stats = ctx.stats
    stats.a2a_seconds += time.perf_counter() - start
    nbytes = send.numel() * send.element_size()
    if backward:
        stats.a2a_calls_bwd += 1
        stats.a2a_bytes_bwd += nbytes
    else:
        stats.a2a_calls_fwd += 1
        stats.a2a_bytes_fwd += nbytes
    return recv


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of a flat buffer; backward sends gradients back along the same routes."""

    @staticmethod
    def forward(
        fctx: Any, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], ctx: SPContext
    ) -> torch.Tensor:
        fctx.splits = (send_splits, recv_splits)
        fctx.sp_ctx = ctx
        return _exchange(send.contiguous(), send_splits, recv_splits, ctx, backward=False)

    @staticmethod
    def backward(fctx: Any, grad_recv: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send_splits, recv_splits = fctx.splits
        grad_send = _exchange(grad_recv.contiguous(), recv_splits, send_splits, fctx.sp_ctx, backward=True)
        return grad_send, None, None, None


def _check_local(name: str, x: torch.Tensor, heads: int, ctx: SPContext) -> None:
    if x.dim() != 3 or x.shape[0] != ctx.local_len or x.shape[1] != heads:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}; expected [S={ctx.local_len}, H={heads}, D] "
            f"(stream T={ctx.total_len}, sp={ctx.sp_size})"
        )


def ulysses_qkv_to_heads(
    q_SHD: torch.Tensor, k_SHD: torch.Tensor, v_SHD: torch.Tensor, ctx: SPContext
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[S, all heads] -> [T, this rank's heads] for q, k and v in one all-to-all.

    Returns q_THD with this rank's hq query heads (layout.q_ranges[rank]) and k_THD, v_THD with the
    hkv kv heads those query heads read (layout.kv_ranges[rank]).
    """
    layout = ctx.layout
    _check_local("q", q_SHD, layout.num_q_heads, ctx)
    _check_local("k", k_SHD, layout.num_kv_heads, ctx)
    _check_local("v", v_SHD, layout.num_kv_heads, ctx)
    if not (q_SHD.dtype == k_SHD.dtype == v_SHD.dtype) or not (q_SHD.shape[2] == k_SHD.shape[2] == v_SHD.shape[2]):
        raise ValueError("q, k and v must share dtype and head dim for the fused all-to-all")
    if ctx.sp_size == 1:
        return q_SHD, k_SHD, v_SHD
    S, D, sp = ctx.local_len, q_SHD.shape[2], ctx.sp_size
    chunks: list[torch.Tensor] = []
    send_splits: list[int] = []
    for rank in range(sp):
        (qs, qe), (ks, ke) = layout.q_ranges[rank], layout.kv_ranges[rank]
        chunks += [q_SHD[:, qs:qe].reshape(-1), k_SHD[:, ks:ke].reshape(-1), v_SHD[:, ks:ke].reshape(-1)]
        send_splits.append(S * (qe - qs + 2 * (ke - ks)) * D)
    hq, hkv = layout.q_count(ctx.sp_rank), layout.kv_count(ctx.sp_rank)
    recv = _AllToAll.apply(torch.cat(chunks), send_splits, [S * (hq + 2 * hkv) * D] * sp, ctx)
    # Each source rank sent [q: S*hq*D | k: S*hkv*D | v: S*hkv*D]; sources are in token order.
    q_part, k_part, v_part = recv.view(sp, S * (hq + 2 * hkv) * D).split([S * hq * D, S * hkv * D, S * hkv * D], dim=1)
    T = ctx.total_len
    return q_part.reshape(T, hq, D), k_part.reshape(T, hkv, D), v_part.reshape(T, hkv, D)


def ulysses_heads_to_seq(o_THD: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """[T, this rank's q heads] -> [S, all q heads] in one all-to-all (inverse of the q part above)."""
    layout = ctx.layout
    hq = layout.q_count(ctx.sp_rank)
    if o_THD.dim() != 3 or o_THD.shape[0] != ctx.total_len or o_THD.shape[1] != hq:
        raise ValueError(f"attention output has shape {tuple(o_THD.shape)}; expected [T={ctx.total_len}, {hq}, D]")
    if ctx.sp_size == 1:
        return o_THD
    S, D, sp = ctx.local_len, o_THD.shape[2], ctx.sp_size
    recv_splits = [S * n * D for n in layout.q_counts]
    recv = _AllToAll.apply(o_THD.reshape(-1), [S * hq * D] * sp, recv_splits, ctx)
    # Source rank r sent its q heads for my S tokens; q ranges are contiguous and in rank order.
    parts = [p.view(S, n, D) for p, n in zip(recv.split(recv_splits), layout.q_counts)]
    return torch.cat(parts, dim=1)


class _GatherSeq(torch.autograd.Function):
    """All-gather along tokens; backward keeps this rank's slice of the incoming gradient."""

    @staticmethod
    def forward(fctx: Any, x_local: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        fctx.sp_ctx = ctx
        pieces = [torch.empty_like(x_local) for _ in range(ctx.sp_size)]
        dist.all_gather(pieces, x_local.contiguous(), group=ctx.group)
        return torch.cat(pieces, dim=0)

    @staticmethod
    def backward(fctx: Any, grad_T: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx: SPContext = fctx.sp_ctx
        return grad_T.narrow(0, ctx.sp_rank * ctx.local_len, ctx.local_len).contiguous(), None


def gather_from_ranks(x_local: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """All-gather local shards [S, ...] into the full stream [T, ...] on every rank.

    Backward returns only this rank's slice of the gradient of the gathered tensor (no
    communication). That is exact for the usual pattern "every rank computes the SAME loss from the
    gathered tensor and the parameter gradients are then SUMMED over the sp group": each rank
    back-propagates its own tokens' share of one copy of the loss, and the sum over ranks is the
    gradient of that loss. It is NOT exact if ranks compute different losses from the gathered
    tensor (that would need a reduce-scatter of the gradient) or if gradients are averaged.
    """
    if x_local.shape[0] != ctx.local_len:
        raise ValueError(f"local tensor has {x_local.shape[0]} tokens, expected S={ctx.local_len}")
    if ctx.sp_size == 1:
        return x_local
    return _GatherSeq.apply(x_local, ctx)
