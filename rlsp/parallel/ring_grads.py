"""Block math of one ring-attention step: forward, a box's partial (out, lse) merged into the rows' running
ones (`attend`); backward, the rows' dq and the visiting K/V block's dK/dV over the step's boxes; with the
fused kernels per tile (rlsp/parallel/ring_block.py) or the explicit score tiles (rlsp/parallel/ring_reference.py).
The ring around it (passing blocks and accumulators, head groups) lives in rlsp/parallel/ring.py (and
rlsp/parallel/ring_direct.py); `BlockCtx` holds the per-call constants they share.

The K/V block (and its dK/dV accumulator) is one buffer: [2, Tr, hkv, D] (k and v stacked) when k and v share
their head dim, else [Tr, hkv, Dk + Dv] (k and v side by side on the last dim: multi-latent attention, whose v head
dim differs from q/k's); `pack_kv` builds it, `split_kv` returns the k and v views of either layout.

Legend: Tr tokens of this rank, Q / K query / key rows of one box (tile), H heads (hq for q and o,
hkv for k and v), D head dim (Dk of q and k, Dv of v).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlsp.parallel import ring_reference
from rlsp.parallel.ring_block import fused_backward, fused_forward
from rlsp.parallel.ring_plan import ROW_CHUNK, StepBlock
from rlsp.parallel.ring_reference import finite


class BlockCtx(NamedTuple):
    """Per-call constants of the block math."""

    scale: float
    kv_index: torch.Tensor | None  # kv head of each q head (None: hq == hkv, head h reads h)
    kernel_index: torch.Tensor | None  # heads the fused kernel needs k/v expanded to (None: as they are)
    fused: bool  # fused kernel (else the explicit reference path)
    kv_per_pass: int | None = None  # kv heads per backward pass (rlsp/parallel/ring_heads.py; None: all)
    row_chunk: int = ROW_CHUNK  # query rows per score tile of the explicit path
    window: int | None = None  # the layer's sliding window (None: plain causal); set: explicit path
    softcap: float | None = None  # attention soft-cap (scores -> cap * tanh(scores / cap)); set: explicit path
    k_dim: int | None = None  # Dk when v's head dim differs (K/V side by side on the last dim); None: stacked


def pack_kv(k_THD: torch.Tensor, v_THD: torch.Tensor) -> torch.Tensor:
    """One K/V buffer to pass around the ring: [2, Tr, hkv, D] when Dk == Dv, else [Tr, hkv, Dk + Dv]."""
    if k_THD.shape[-1] == v_THD.shape[-1]:
        return torch.stack([k_THD, v_THD])
    return torch.cat([k_THD, v_THD], dim=-1)


def split_kv(kv: torch.Tensor, k_dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) views of a buffer from `pack_kv` (or its dK/dV accumulator); `k_dim` is Dk of the side-by-side one."""
    if k_dim is None:
        return kv[0], kv[1]
    return kv[..., :k_dim], kv[..., k_dim:]


def expand(x_KHD: torch.Tensor, kv_index: torch.Tensor | None) -> torch.Tensor:
    return x_KHD if kv_index is None else x_KHD.index_select(1, kv_index)


def merge(out_QHD: torch.Tensor, lse_HQ: torch.Tensor, o_QHD: torch.Tensor, blk_lse_HQ: torch.Tensor) -> None:
    """In place: (out, lse) <- log-sum-exp merge of (out, lse) and a block's (o, lse)."""
    new_HQ = torch.logaddexp(lse_HQ, blk_lse_HQ)
    safe_HQ = finite(new_HQ)
    w_old_QH1, w_blk_QH1 = (torch.exp(x - safe_HQ).T[..., None] for x in (lse_HQ, blk_lse_HQ))
    out_QHD.mul_(w_old_QH1).add_(o_QHD * w_blk_QH1)
    lse_HQ.copy_(new_HQ)


def attend(q_THD: torch.Tensor, kv_2THD: torch.Tensor, block: StepBlock, ctx: BlockCtx, out_THD: torch.Tensor,
           lse_HT: torch.Tensor) -> None:
    """Merge one box's partial (out, lse) into the running (out_THD, lse_HT), tile by tile when fused."""
    if not ctx.fused:
        k_KHD, v_KHD = (expand(x[block.k0:block.k1], ctx.kv_index) for x in split_kv(kv_2THD, ctx.k_dim))
        o_QHD, lse_HQ = ring_reference.attend_box(q_THD[block.q0:block.q1], k_KHD, v_KHD, block, ctx.scale,
                                                  ctx.row_chunk, ctx.softcap)
        merge(out_THD[block.q0:block.q1], lse_HT[:, block.q0:block.q1], o_QHD, lse_HQ)
        return
    for tile in block.tiles:
        k_KHD, v_KHD = (expand(x[tile.k0:tile.k1], ctx.kernel_index) for x in split_kv(kv_2THD, ctx.k_dim))
        o_QHD, lse_HQ = fused_forward(q_THD[tile.q0:tile.q1], k_KHD, v_KHD, tile.causal, ctx.scale)
        merge(out_THD[tile.q0:tile.q1], lse_HT[:, tile.q0:tile.q1], o_QHD, lse_HQ)


Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, BlockCtx]  # out, lse, delta (explicit path), ctx


def block_grads(do_THD: torch.Tensor, q_THD: torch.Tensor, kv_2THD: torch.Tensor, blocks: list[StepBlock],
                saved: Saved, dq_THD: torch.Tensor) -> torch.Tensor:
    """Add one step's dq into dq_THD; return the visiting block's dK/dV part, laid out as the K/V buffer (fp32/fp64)."""
    dkv_2THD = kv_2THD.new_zeros(kv_2THD.shape, dtype=dq_THD.dtype)
    for block in blocks:
        if saved[3].fused:
            _add_fused_grads(do_THD, q_THD, kv_2THD, block, saved, dq_THD, dkv_2THD)
        else:
            _add_explicit_grads(do_THD, q_THD, kv_2THD, block, saved, dq_THD, dkv_2THD)
    return dkv_2THD


def _add_kv_grads(dkv_2THD: torch.Tensor, keys: slice, dk_KHD: torch.Tensor, dv_KHD: torch.Tensor,
                  index: torch.Tensor | None, k_dim: int | None) -> None:
    dk_THD, dv_THD = split_kv(dkv_2THD, k_dim)
    for dst_KHD, grad_KHD in ((dk_THD[keys], dk_KHD), (dv_THD[keys], dv_KHD)):
        if index is None:
            dst_KHD.add_(grad_KHD)  # boxes (tiles) of different segments may overlap: accumulate
        else:  # sum the expanded heads' gradients back onto the kv heads before they travel
            dst_KHD.index_add_(1, index, grad_KHD.to(dst_KHD.dtype))


def _add_fused_grads(do_THD: torch.Tensor, q_THD: torch.Tensor, kv_2THD: torch.Tensor, block: StepBlock,
                     saved: Saved, dq_THD: torch.Tensor, dkv_2THD: torch.Tensor) -> None:
    out_THD, lse_HT, _, ctx = saved
    for tile in block.tiles:
        rows, keys = slice(tile.q0, tile.q1), slice(tile.k0, tile.k1)
        k_KHD, v_KHD = (expand(x[keys], ctx.kernel_index) for x in split_kv(kv_2THD, ctx.k_dim))
        dq_QHD, dk_KHD, dv_KHD = fused_backward(do_THD[rows], q_THD[rows], k_KHD, v_KHD, out_THD[rows],
                                                lse_HT[:, rows], tile.causal, ctx.scale)
        dq_THD[rows] += dq_QHD
        _add_kv_grads(dkv_2THD, keys, dk_KHD, dv_KHD, ctx.kernel_index, ctx.k_dim)


def _add_explicit_grads(do_THD: torch.Tensor, q_THD: torch.Tensor, kv_2THD: torch.Tensor, block: StepBlock,
                        saved: Saved, dq_THD: torch.Tensor, dkv_2THD: torch.Tensor) -> None:
    _, lse_HT, delta_HT, ctx = saved
    assert delta_HT is not None  # computed whenever the explicit path runs
    rows, keys = slice(block.q0, block.q1), slice(block.k0, block.k1)
    k_KHD, v_KHD = (expand(x[keys], ctx.kv_index) for x in split_kv(kv_2THD, ctx.k_dim))
    dq_QHD, dk_KHD, dv_KHD = ring_reference.attend_box_backward(
        do_THD[rows], q_THD[rows], k_KHD, v_KHD, block, ctx.scale, lse_HT[:, rows], delta_HT[:, rows], ctx.row_chunk,
        ctx.softcap)
    dq_THD[rows] += dq_QHD
    _add_kv_grads(dkv_2THD, keys, dk_KHD, dv_KHD, ctx.kv_index, ctx.k_dim)
