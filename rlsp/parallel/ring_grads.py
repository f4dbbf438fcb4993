"""Backward block math of one ring-attention step: the rows' dq and the visiting K/V block's dK/dV over
the step's boxes, with the fused kernels per tile (rlsp/parallel/ring_block.py) or the explicit
score tiles (rlsp/parallel/ring_reference.py). The ring around it (passing blocks and accumulators,
head groups) lives in rlsp/parallel/ring.py; `BlockCtx` holds the per-call constants both share.

Legend: Tr tokens of this rank, Q / K query / key rows of one box (tile), H heads (hq for q and o,
hkv for k and v), D head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlsp.parallel import ring_reference
from rlsp.parallel.ring_block import fused_backward
from rlsp.parallel.ring_plan import ROW_CHUNK, StepBlock


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


def expand(x_KHD: torch.Tensor, kv_index: torch.Tensor | None) -> torch.Tensor:
    return x_KHD if kv_index is None else x_KHD.index_select(1, kv_index)


Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, BlockCtx]  # out, lse, delta (explicit path), ctx


def block_grads(do_THD: torch.Tensor, q_THD: torch.Tensor, kv_2THD: torch.Tensor, blocks: list[StepBlock],
                saved: Saved, dq_THD: torch.Tensor) -> torch.Tensor:
    """Add one step's dq into dq_THD; return the visiting block's dK/dV part [2, Tr, hkv, D] (fp32/fp64)."""
    dkv_2THD = kv_2THD.new_zeros(kv_2THD.shape, dtype=dq_THD.dtype)
    for block in blocks:
        if saved[3].fused:
            _add_fused_grads(do_THD, q_THD, kv_2THD, block, saved, dq_THD, dkv_2THD)
        else:
            _add_explicit_grads(do_THD, q_THD, kv_2THD, block, saved, dq_THD, dkv_2THD)
    return dkv_2THD


def _add_kv_grads(dkv_2THD: torch.Tensor, keys: slice, dk_KHD: torch.Tensor, dv_KHD: torch.Tensor,
                  index: torch.Tensor | None) -> None:
    for dst_KHD, grad_KHD in ((dkv_2THD[0, keys], dk_KHD), (dkv_2THD[1, keys], dv_KHD)):
        if index is None:
            dst_KHD.add_(grad_KHD)  # boxes (tiles) of different segments may overlap: accumulate
        else:  # sum the expanded heads' gradients back onto the kv heads before they travel
            dst_KHD.index_add_(1, index, grad_KHD.to(dst_KHD.dtype))


def _add_fused_grads(do_THD: torch.Tensor, q_THD: torch.Tensor, kv_2THD: torch.Tensor, block: StepBlock,
                     saved: Saved, dq_THD: torch.Tensor, dkv_2THD: torch.Tensor) -> None:
    out_THD, lse_HT, _, ctx = saved
    for tile in block.tiles:
        rows, keys = slice(tile.q0, tile.q1), slice(tile.k0, tile.k1)
        k_KHD, v_KHD = (expand(x[keys], ctx.kernel_index) for x in kv_2THD)
        dq_QHD, dk_KHD, dv_KHD = fused_backward(do_THD[rows], q_THD[rows], k_KHD, v_KHD, out_THD[rows],
                                                lse_HT[:, rows], tile.causal, ctx.scale)
        dq_THD[rows] += dq_QHD
        _add_kv_grads(dkv_2THD, keys, dk_KHD, dv_KHD, ctx.kernel_index)


def _add_explicit_grads(do_THD: torch.Tensor, q_THD: torch.Tensor, kv_2THD: torch.Tensor, block: StepBlock,
                        saved: Saved, dq_THD: torch.Tensor, dkv_2THD: torch.Tensor) -> None:
    _, lse_HT, delta_HT, ctx = saved
    assert delta_HT is not None  # computed whenever the explicit path runs
    rows, keys = slice(block.q0, block.q1), slice(block.k0, block.k1)
    k_KHD, v_KHD = (expand(x[keys], ctx.kv_index) for x in kv_2THD)
    dq_QHD, dk_KHD, dv_KHD = ring_reference.attend_box_backward(
        do_THD[rows], q_THD[rows], k_KHD, v_KHD, block, ctx.scale, lse_HT[:, rows], delta_HT[:, rows], ctx.row_chunk,
        ctx.softcap)
    dq_THD[rows] += dq_QHD
    _add_kv_grads(dkv_2THD, keys, dk_KHD, dv_KHD, ctx.kv_index)
