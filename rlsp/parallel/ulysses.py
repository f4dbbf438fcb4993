"""Ulysses sequence parallelism: shard a packed token stream over an sp group, autograd all-to-alls.

The sequence-parallel group of a rank is ulysses x ring ranks. Outside attention each rank holds
S = T / (ulysses * ring) tokens of the packed stream with all heads: ring rank i holds the zigzag
chunks i and 2r-1-i of the stream (`rlsp.parallel.ring.zigzag_indices`; the whole stream at ring 1)
and each Ulysses rank a consecutive slice of those Tr = T / ring tokens. Per attention layer:
  1. `ulysses_qkv_to_heads`: ONE all_to_all_single on one contiguous buffer carrying q, k and v turns
     [S, all heads] into [Tr, this rank's heads] (kv heads replicated only where the layout needs it);
     each of q, k, v travels with its own head dim (multi-latent attention: v's differs from q/k's);
  2. attention for those heads: over the ring rank's Tr tokens when ring == 1 (varlen, from the
     context's cu_seqlens), else ring attention over the whole stream (`rlsp.parallel.ring`);
  3. `ulysses_heads_to_seq`: ONE all_to_all_single back to [S, all q heads].
Both exchanges are autograd functions whose backward is the inverse exchange. Nothing here is
global: every function takes the `SPContext`, which carries the groups, the stream metadata computed
once per micro-batch (cu_seqlens is never communicated) and per-forward counters.

Legend: T packed stream length (multiple of ulysses x ring, x2 with a ring), Tr = T / ring tokens of a
ring rank, S = Tr / ulysses local tokens, H heads, D head dim (Dq, Dk, Dv: q's, k's, v's), Hq / Hkv all
query / kv heads,
hq / hkv this rank's query / kv heads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlsp.data.packing import PackedBatch
from rlsp.parallel.heads import HeadLayout, plan_head_layout
from rlsp.parallel.ring_plan import RingPlan, build_ring_plan, zigzag_indices


@dataclass
class SPStats:
    """Counters of one forward/backward. Bytes are the send-buffer sizes handed to all_to_all_single
    (the rank's own chunk included) and to the ring's point-to-point sends. Seconds are host wall time
    around the all-to-all (exact for gloo; for asynchronous backends such as NCCL it measures the
    launch only). A backward recomputation under activation checkpointing counts as forward calls."""

    attn_calls: int = 0
    a2a_calls_fwd: int = 0
    a2a_bytes_fwd: int = 0
    a2a_calls_bwd: int = 0
    a2a_bytes_bwd: int = 0
    a2a_seconds: float = 0.0
    ring_calls_fwd: int = 0
    ring_bytes_fwd: int = 0
    ring_calls_bwd: int = 0
    ring_bytes_bwd: int = 0
    ring_blocks_computed: int = 0  # ring steps whose visiting K/V block some row sees (windowed layers skip others)
    ring_blocks_skipped: int = 0
    ring_blocks_not_sent: int = 0  # K/V blocks a windowed layer does not send (nobody sees them: ring_direct)
    ring_bytes_not_sent: int = 0  # bytes the relay would have sent beyond those sent, forward and backward

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0.0 if name == "a2a_seconds" else 0)


@dataclass
class SPContext:
    """Everything attention needs about the sequence-parallel groups and the packed stream of one
    micro-batch. `group`, `ulysses_size`, `ulysses_rank` describe the Ulysses group (head exchange);
    `ring` the ring group (None at ring 1)."""

    group: dist.ProcessGroup | None
    ulysses_size: int
    ulysses_rank: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    total_len: int
    layout: HeadLayout
    ring: RingPlan | None = None
    stats: SPStats = field(default_factory=SPStats)
    # Per-micro-batch derived metadata (device copies of cu_seqlens, segment bounds), built lazily
    # by the first attention layer and reused by the others.
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def ring_size(self) -> int:
        return 1 if self.ring is None else self.ring.ring_size

    @property
    def ring_rank(self) -> int:
        return 0 if self.ring is None else self.ring.ring_rank

    @property
    def heads_len(self) -> int:
        """Tr: tokens each rank holds inside attention (its ring rank's share of the stream)."""
        return self.total_len // self.ring_size

    @property
    def local_len(self) -> int:
        """S: tokens held by each rank outside attention."""
        return self.heads_len // self.ulysses_size

    @property
    def local_index(self) -> torch.Tensor:
        """Stream positions [S] of this rank's tokens, in the order the rank holds them."""
        if "local_index" not in self.cache:
            ring_tokens = zigzag_indices(self.total_len, self.ring_size, self.ring_rank)
            self.cache["local_index"] = ring_tokens.narrow(0, self.ulysses_rank * self.local_len, self.local_len)
        return self.cache["local_index"]


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def build_sp_context(
    group: dist.ProcessGroup | None, packed: PackedBatch, num_q_heads: int, num_kv_heads: int,
    ring_group: dist.ProcessGroup | None = None, ring_dkv_group: dist.ProcessGroup | None = None,
) -> SPContext:
    """Context for one packed micro-batch over a Ulysses `group` and a `ring_group` (None: degree 1, same
    code path without collectives). `num_q_heads`/`num_kv_heads` are the heads the model's attention
    sees (all of them, or one tensor-parallel rank's share). `ring_dkv_group`: the ring's ranks again,
    the communicator of ring attention's dK/dV accumulators (rlsp.parallel.ring)."""
    uly_size, uly_rank = _group_size_rank(group)
    ring_size, _ = _group_size_rank(ring_group)
    total = packed.total_len
    multiple = uly_size * ring_size * (2 if ring_size > 1 else 1)
    if total % multiple != 0:
        raise ValueError(
            f"packed stream has {total} tokens, not a multiple of {multiple} (ulysses={uly_size}, ring={ring_size}"
            f"{', x2 for the zigzag' if ring_size > 1 else ''}); pack with pad_to_multiple={multiple}"
        )
    cu = packed.cu_seqlens.to(torch.int32)
    return SPContext(
        group=group,
        ulysses_size=uly_size,
        ulysses_rank=uly_rank,
        cu_seqlens=cu,
        max_seqlen=packed.max_seqlen,
        total_len=total,
        layout=plan_head_layout(num_q_heads, num_kv_heads, uly_size),
        ring=None if ring_group is None else build_ring_plan(ring_group, cu, total, dkv_group=ring_dkv_group),
    )


def shard_for_rank(x_T: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """This rank's tokens [S, ...] of a full-stream tensor [T, ...] (a view at ring 1)."""
    if x_T.shape[0] != ctx.total_len:
        raise ValueError(f"tensor has {x_T.shape[0]} tokens, the stream has {ctx.total_len}")
    if ctx.ring_size == 1:
        return x_T.narrow(0, ctx.ulysses_rank * ctx.local_len, ctx.local_len)
    return x_T.index_select(0, ctx.local_index.to(x_T.device))


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


def all_to_all_flat(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], ctx: SPContext) -> torch.Tensor:
    """Autograd all-to-all of a flat buffer over the Ulysses group (element counts per rank); layers that exchange
    their own layouts (rlsp.models.linear_attention's head groups) use it, counted in the context's stats."""
    return _AllToAll.apply(send, send_splits, recv_splits, ctx)


def _check_local(name: str, x: torch.Tensor, heads: int, ctx: SPContext) -> None:
    if x.dim() != 3 or x.shape[0] != ctx.local_len or x.shape[1] != heads:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}; expected [S={ctx.local_len}, H={heads}, D] "
            f"(stream T={ctx.total_len}, ulysses={ctx.ulysses_size}, ring={ctx.ring_size})"
        )


def ulysses_qkv_to_heads(
    q_SHD: torch.Tensor, k_SHD: torch.Tensor, v_SHD: torch.Tensor, ctx: SPContext
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[S, all heads] -> [Tr, this rank's heads] for q, k and v in one all-to-all.

    Returns q_THD with this rank's hq query heads (layout.q_ranges[rank]) and k_THD, v_THD with the
    hkv kv heads those query heads read (layout.kv_ranges[rank]). q, k and v keep their own head dims
    (Dq, Dk, Dv): each rank's chunk is [q: S*hq*Dq | k: S*hkv*Dk | v: S*hkv*Dv], so multi-latent
    attention (Dv != Dq) needs no padding and no second exchange.
    """
    layout = ctx.layout
    _check_local("q", q_SHD, layout.num_q_heads, ctx)
    _check_local("k", k_SHD, layout.num_kv_heads, ctx)
    _check_local("v", v_SHD, layout.num_kv_heads, ctx)
    if not (q_SHD.dtype == k_SHD.dtype == v_SHD.dtype):
        raise ValueError(f"q, k and v must share one dtype for the fused all-to-all; got {q_SHD.dtype}, "
                         f"{k_SHD.dtype}, {v_SHD.dtype}")
    if ctx.ulysses_size == 1:
        return q_SHD, k_SHD, v_SHD
    S, sp = ctx.local_len, ctx.ulysses_size
    Dq, Dk, Dv = q_SHD.shape[2], k_SHD.shape[2], v_SHD.shape[2]
    chunks: list[torch.Tensor] = []
    send_splits: list[int] = []
    for rank in range(sp):
        (qs, qe), (ks, ke) = layout.q_ranges[rank], layout.kv_ranges[rank]
        chunks += [q_SHD[:, qs:qe].reshape(-1), k_SHD[:, ks:ke].reshape(-1), v_SHD[:, ks:ke].reshape(-1)]
        send_splits.append(S * ((qe - qs) * Dq + (ke - ks) * (Dk + Dv)))
    hq, hkv = layout.q_count(ctx.ulysses_rank), layout.kv_count(ctx.ulysses_rank)
    widths = [S * hq * Dq, S * hkv * Dk, S * hkv * Dv]
    recv = _AllToAll.apply(torch.cat(chunks), send_splits, [sum(widths)] * sp, ctx)
    # Each source rank sent [q | k | v] for its S tokens; sources are in token order.
    q_part, k_part, v_part = recv.view(sp, sum(widths)).split(widths, dim=1)
    Tr = ctx.heads_len
    return q_part.reshape(Tr, hq, Dq), k_part.reshape(Tr, hkv, Dk), v_part.reshape(Tr, hkv, Dv)


def ulysses_heads_to_seq(o_THD: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """[Tr, this rank's q heads] -> [S, all q heads] in one all-to-all (inverse of the q part above); D is the
    output's head dim (v's: Dv), the same on every rank."""
    layout = ctx.layout
    hq = layout.q_count(ctx.ulysses_rank)
    if o_THD.dim() != 3 or o_THD.shape[0] != ctx.heads_len or o_THD.shape[1] != hq:
        raise ValueError(f"attention output has shape {tuple(o_THD.shape)}; expected [Tr={ctx.heads_len}, {hq}, D]")
    if ctx.ulysses_size == 1:
        return o_THD
    S, D, sp = ctx.local_len, o_THD.shape[2], ctx.ulysses_size
    recv_splits = [S * n * D for n in layout.q_counts]
    recv = _AllToAll.apply(o_THD.reshape(-1), [S * hq * D] * sp, recv_splits, ctx)
    # Source rank r sent its q heads for my S tokens; q ranges are contiguous and in rank order.
    parts = [p.view(S, n, D) for p, n in zip(recv.split(recv_splits), layout.q_counts)]
    return torch.cat(parts, dim=1)


class _GatherSeq(torch.autograd.Function):
    """All-gather along tokens over `group`; backward keeps this rank's slice of the incoming gradient."""

    @staticmethod
    def forward(fctx: Any, x_local: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int) -> torch.Tensor:
        fctx.rank, fctx.n = rank, x_local.shape[0]
        pieces = [torch.empty_like(x_local) for _ in range(size)]
        dist.all_gather(pieces, x_local.contiguous(), group=group)
        return torch.cat(pieces, dim=0)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad.narrow(0, fctx.rank * fctx.n, fctx.n).contiguous(), None, None, None


def _stream_order(ctx: SPContext) -> torch.Tensor:
    """Positions in the ring-gathered tensor (ring rank 0's tokens, then rank 1's, ...) of each stream token."""
    if "stream_order" not in ctx.cache:
        held = torch.cat([zigzag_indices(ctx.total_len, ctx.ring_size, r) for r in range(ctx.ring_size)])
        ctx.cache["stream_order"] = torch.argsort(held)
    return ctx.cache["stream_order"]


def gather_from_ranks(x_local: torch.Tensor, ctx: SPContext) -> torch.Tensor:
    """All-gather local shards [S, ...] into the full stream [T, ...] (stream order) on every rank.

    Backward returns only this rank's slice of the gradient of the gathered tensor (no
    communication). That is exact for the usual pattern "every rank computes the SAME loss from the
    gathered tensor and the parameter gradients are then SUMMED over the sp group": each rank
    back-propagates its own tokens' share of one copy of the loss, and the sum over ranks is the
    gradient of that loss. It is NOT exact if ranks compute different losses from the gathered
    tensor (that would need a reduce-scatter of the gradient) or if gradients are averaged.
    """
    if x_local.shape[0] != ctx.local_len:
        raise ValueError(f"local tensor has {x_local.shape[0]} tokens, expected S={ctx.local_len}")
    x = x_local
    if ctx.ulysses_size > 1:
        x = _GatherSeq.apply(x, ctx.group, ctx.ulysses_size, ctx.ulysses_rank)
    if ctx.ring_size > 1:
        x = _GatherSeq.apply(x, ctx.ring.group, ctx.ring_size, ctx.ring_rank)
        x = x.index_select(0, _stream_order(ctx).to(x.device))
    return x
