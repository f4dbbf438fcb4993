"""Ring attention for ring (context) parallelism: exact causal varlen attention over a packed stream
whose tokens are spread over the ranks of a ring group, by passing K/V blocks around the ring.

Token placement (zigzag: ring rank i holds chunks i and 2r-1-i of 2r) and the per-step visible boxes
come from the micro-batch's `RingPlan` (rlsp/parallel/ring_plan.py). Each rank holds q/k/v for its own
Tr = T / r tokens and the same heads as every other rank of its ring.

Forward, at step s = 0..r-1 a rank holds the K/V block of ring rank (i - s) mod r: it computes
the block's partial output and log-sum-exp (fp32, or fp64 for fp64 inputs), merges them into its
running (out, lse), and meanwhile passes the block on to rank i+1 (receiving the next one from
i-1). Backward is written out: delta = rowsum(dO * O); at each step dq is accumulated locally and
the visiting block's dk/dv contribution is added to an accumulator that travels around the ring
with the block and reaches its owner after the last step. Only the local q, k, v, out and lse are
saved. A step whose plan has no visible box is skipped (its block still travels).

Bytes SENT by a rank per call (r > 1; nothing when r == 1), e_in = element size of q/k/v,
e_acc = 4 (8 for fp64 inputs):
  forward:  (r-1) * 2*Tr*hkv*D * e_in                  (K and V in one buffer, hkv heads only)
  backward: (r-1) * 2*Tr*hkv*D * (e_in + e_acc)        (K/V again, plus the dK/dV accumulators)
The dK/dV accumulator of block j starts at rank j+1 and ends at j (r-1 hops); j adds its own part.

Why sends and receives match on NCCL. NCCL ignores tags: between two ranks of one communicator the
k-th send of i to j meets the k-th receive of j from i, whatever their sizes. Two guarantees:
- Separate communicators. The dK/dV accumulators travel on `plan.grad_group`: the plan's `dkv_group`
  when it was built with one (`build_ring_plan(..., dkv_group=ParallelDims.ring_dkv_group)`, a second
  group over the ring's ranks created once with the meshes), so K/V blocks and accumulators never
  share a communicator's queue, whatever order they are issued in; else the ring group itself.
- The same program on every rank. Each communicator's ops are issued by a loop whose shape depends
  only on the ring size, never on the data, the plan's boxes or the rank: forward, steps 0..r-2 each
  post one batch (send to i+1, receive from i-1) of the same [2, Tr, hkv, D] K/V buffer; backward,
  the same K/V batches at steps 0..r-2 and, at steps 1..r-1, one batch of the [2, Tr, hkv, D]
  accumulator in fp32 (fp64). A step without a visible box still posts its batches, and a rank whose
  ring group has no heads returns before any (every rank of a ring group holds the same heads). So
  i's sends to j and j's receives from i are the same sequence, in order and shape, on each group,
  and also when both passes share one group (`dkv_group=None`: K/V then accumulator within a step on
  every rank); every rank of the group posts every batch, the first one included, as NCCL requires of
  a group's first batched call. tests/distributed/test_ring_order.py records each rank's ops on
  gloo at ring 2 and 4 and checks exactly this.
Both communicators issue in the same order on every rank (K/V first in each step), so concurrent
kernels of the two cannot wait on each other in opposite orders.

The block math (`block_attention`, `block_attention_backward`) is kept apart so a fused kernel can
replace it. Here it materialises the scores of ROW_CHUNK query rows of one box at a time in fp32
(peak about 3 * hq * ROW_CHUNK * K * 4 bytes: scores, probabilities, their gradient); the plan keeps
only 1-D positions and segment ids per box (O(Tr) per step) and derives each row chunk's mask.

Legend: T stream length, r ring size, Tr = T / r tokens of this rank, Q / K query / key rows of
one block (its bounding box), H heads (hq for q and o, hkv for k and v), D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlsp.parallel.ring_plan import ROW_CHUNK, RingPlan, StepBlock

_KV_TAG, _DKV_TAG = 0, 1


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_attention(q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, mask_QK: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of one block (k/v already with hq heads) -> (o [Q, H, D], lse [H, Q]).

    Accumulates in fp32 (fp64 for fp64 inputs) and returns that dtype. A row without visible keys
    gets o = 0 and lse = -inf.
    """
    acc = _acc_dtype(q_QHD.dtype)
    scores_HQK = torch.einsum("qhd,khd->hqk", q_QHD.to(acc), k_KHD.to(acc)) * scale
    scores_HQK = scores_HQK.masked_fill(~mask_QK, float("-inf"))
    lse_HQ = torch.logsumexp(scores_HQK, dim=-1)
    probs_HQK = torch.exp(scores_HQK - _finite(lse_HQ)[..., None])
    return torch.einsum("hqk,khd->qhd", probs_HQK, v_KHD.to(acc)), lse_HQ


def block_attention_backward(do_QHD: torch.Tensor, q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor,
                             mask_QK: torch.Tensor, scale: float, lse_HQ: torch.Tensor,
                             delta_HQ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block given the FINAL lse and delta = rowsum(dO * O) of the rows.

    Returns fp32 (fp64) tensors shaped like q, k, v (k/v with hq heads).
    """
    acc = _acc_dtype(q_QHD.dtype)
    q, k, v, do = (x.to(acc) for x in (q_QHD, k_KHD, v_KHD, do_QHD))
    scores_HQK = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs_HQK = torch.exp(scores_HQK.masked_fill(~mask_QK, float("-inf")) - _finite(lse_HQ)[..., None])
    dv_KHD = torch.einsum("hqk,qhd->khd", probs_HQK, do)
    dprobs_HQK = torch.einsum("qhd,khd->hqk", do, v)
    dscores_HQK = probs_HQK * (dprobs_HQK - delta_HQ[..., None]) * scale
    return torch.einsum("hqk,khd->qhd", dscores_HQK, k), torch.einsum("hqk,qhd->khd", dscores_HQK, q), dv_KHD


def _attend_box(q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, block: StepBlock,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_attention` over one box, ROW_CHUNK query rows at a time (rows are independent)."""
    parts = [block_attention(q_QHD[r0:r0 + ROW_CHUNK], k_KHD, v_KHD, block.mask(r0, r0 + ROW_CHUNK), scale)
             for r0 in range(0, q_QHD.shape[0], ROW_CHUNK)]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts], dim=1)


def _attend_box_backward(do_QHD: torch.Tensor, q_QHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor,
                         block: StepBlock, scale: float, lse_HQ: torch.Tensor,
                         delta_HQ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`block_attention_backward` over one box in row chunks: dq per chunk, dk/dv summed over chunks."""
    dqs, dk_KHD, dv_KHD = [], None, None
    for r0 in range(0, q_QHD.shape[0], ROW_CHUNK):
        rows = slice(r0, r0 + ROW_CHUNK)
        dq, dk, dv = block_attention_backward(do_QHD[rows], q_QHD[rows], k_KHD, v_KHD, block.mask(r0, r0 + ROW_CHUNK),
                                              scale, lse_HQ[:, rows], delta_HQ[:, rows])
        dqs.append(dq)
        dk_KHD, dv_KHD = (dk, dv) if dk_KHD is None else (dk_KHD + dk, dv_KHD + dv)
    return torch.cat(dqs), dk_KHD, dv_KHD


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows without keys) replaced by 0, so exp(-inf - lse) is 0, never NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _merge(out_QHD: torch.Tensor, lse_HQ: torch.Tensor, o_QHD: torch.Tensor, blk_lse_HQ: torch.Tensor) -> None:
    """In place: (out, lse) <- log-sum-exp merge of (out, lse) and a block's (o, lse)."""
    new_HQ = torch.logaddexp(lse_HQ, blk_lse_HQ)
    safe_HQ = _finite(new_HQ)
    w_old_QH1, w_blk_QH1 = (torch.exp(x - safe_HQ).T[..., None] for x in (lse_HQ, blk_lse_HQ))
    out_QHD.mul_(w_old_QH1).add_(o_QHD * w_blk_QH1)
    lse_HQ.copy_(new_HQ)


def _pass_on(plan: RingPlan, send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None,
             tag: int) -> list[dist.Work]:
    """Send `send` to ring rank i+1 and receive `recv` from i-1 on `group` (asynchronous; wait on the result)."""
    ops = [dist.P2POp(dist.isend, send, plan.next_peer, group, tag),
           dist.P2POp(dist.irecv, recv, plan.prev_peer, group, tag)]
    return dist.batch_isend_irecv(ops)


def _pass_kv(plan: RingPlan, step: int, kv_2THD: torch.Tensor) -> tuple[list[dist.Work], torch.Tensor, int]:
    """Start passing the held K/V block on (not after the last step) -> (works, next block, bytes sent)."""
    if step == plan.ring_size - 1:
        return [], kv_2THD, 0
    next_2THD = torch.empty_like(kv_2THD)
    return _pass_on(plan, kv_2THD, next_2THD, plan.group, _KV_TAG), next_2THD, kv_2THD.numel() * kv_2THD.element_size()


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _expand(x_KHD: torch.Tensor, kv_index: torch.Tensor | None) -> torch.Tensor:
    return x_KHD if kv_index is None else x_KHD.index_select(1, kv_index)


def _count(stats: Any, suffix: str, nbytes: int) -> None:
    if stats is not None:
        setattr(stats, f"ring_bytes_{suffix}", getattr(stats, f"ring_bytes_{suffix}") + nbytes)
        setattr(stats, f"ring_calls_{suffix}", getattr(stats, f"ring_calls_{suffix}") + 1)


def _ring_forward(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, plan: RingPlan, scale: float,
                  kv_index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (out [Tr, hq, D] in q's dtype, lse [hq, Tr] fp32/fp64, bytes sent)."""
    acc, (Tr, hq, D) = _acc_dtype(q_THD.dtype), q_THD.shape
    out_THD = q_THD.new_zeros((Tr, hq, D), dtype=acc)
    lse_HT = q_THD.new_full((hq, Tr), float("-inf"), dtype=acc)
    kv_2THD, sent = torch.stack([k_THD, v_THD]), 0
    for step, blocks in enumerate(plan.step_blocks(q_THD.device)):
        works, next_2THD, nbytes = _pass_kv(plan, step, kv_2THD)  # pass the block on while computing with it
        sent += nbytes
        for block in blocks:
            k_KHD, v_KHD = (_expand(x[block.k0:block.k1], kv_index) for x in kv_2THD)
            o_QHD, lse_HQ = _attend_box(q_THD[block.q0:block.q1], k_KHD, v_KHD, block, scale)
            _merge(out_THD[block.q0:block.q1], lse_HT[:, block.q0:block.q1], o_QHD, lse_HQ)
        _wait(works)
        kv_2THD = next_2THD
    return out_THD.to(q_THD.dtype), lse_HT, sent


def _block_grads(do_THD: torch.Tensor, q_THD: torch.Tensor, kv_2THD: torch.Tensor, blocks: list[StepBlock],
                 saved: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None],
                 dq_THD: torch.Tensor) -> torch.Tensor:
    """Add one step's dq into dq_THD; return the visiting block's dK/dV part [2, Tr, hkv, D] (fp32/fp64)."""
    dkv_2THD = kv_2THD.new_zeros(kv_2THD.shape, dtype=dq_THD.dtype)
    for block in blocks:
        _add_block_grads(do_THD, q_THD, kv_2THD, block, saved, dq_THD, dkv_2THD)
    return dkv_2THD


def _add_block_grads(do_THD: torch.Tensor, q_THD: torch.Tensor, kv_2THD: torch.Tensor, block: StepBlock,
                     saved: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None], dq_THD: torch.Tensor,
                     dkv_2THD: torch.Tensor) -> None:
    lse_HT, delta_HT, scale, kv_index = saved
    rows, keys = slice(block.q0, block.q1), slice(block.k0, block.k1)
    k_KHD, v_KHD = (_expand(x[keys], kv_index) for x in kv_2THD)
    dq_QHD, dk_KHD, dv_KHD = _attend_box_backward(do_THD[rows], q_THD[rows], k_KHD, v_KHD, block, scale,
                                                  lse_HT[:, rows], delta_HT[:, rows])
    dq_THD[rows] += dq_QHD
    for dst_KHD, grad_KHD in ((dkv_2THD[0, keys], dk_KHD), (dkv_2THD[1, keys], dv_KHD)):
        if kv_index is None:
            dst_KHD.add_(grad_KHD)  # boxes of different segments may overlap: accumulate
        else:  # sum the expanded heads' gradients back onto the kv heads before they travel
            dst_KHD.index_add_(1, kv_index, grad_KHD)


def _ring_backward(do_THD: torch.Tensor, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
                   out_THD: torch.Tensor, lse_HT: torch.Tensor, plan: RingPlan, scale: float,
                   kv_index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """-> (dq, dk, dv in the inputs' dtypes, bytes sent)."""
    acc = lse_HT.dtype
    delta_HT = (do_THD.to(acc) * out_THD.to(acc)).sum(dim=-1).T.contiguous()
    saved = (lse_HT, delta_HT, scale, kv_index)
    dq_THD = q_THD.new_zeros(q_THD.shape, dtype=acc)
    kv_2THD, sent, own_2THD, dkv_works, dkv_recv = torch.stack([k_THD, v_THD]), 0, None, None, None
    for step, blocks in enumerate(plan.step_blocks(q_THD.device)):
        kv_works, next_2THD, nbytes = _pass_kv(plan, step, kv_2THD)
        sent += nbytes
        dkv_2THD = _block_grads(do_THD, q_THD, kv_2THD, blocks, saved, dq_THD)
        if step == 0:
            own_2THD = dkv_2THD  # this rank's block: its accumulator comes back after the last step
        else:
            if dkv_works is not None:  # the accumulator of the block held now, from rank i-1
                _wait(dkv_works)
                dkv_2THD += dkv_recv
            dkv_recv = torch.empty_like(dkv_2THD)
            dkv_works = _pass_on(plan, dkv_2THD, dkv_recv, plan.grad_group, _DKV_TAG)
            sent += dkv_2THD.numel() * dkv_2THD.element_size()
        _wait(kv_works)
        kv_2THD = next_2THD
    if dkv_works is not None:
        _wait(dkv_works)
        own_2THD += dkv_recv
    return dq_THD.to(q_THD.dtype), own_2THD[0].to(k_THD.dtype), own_2THD[1].to(v_THD.dtype), sent


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, plan: RingPlan,
                scale: float, kv_index: torch.Tensor | None, stats: Any) -> torch.Tensor:
        out_THD, lse_HT, sent = _ring_forward(q_THD, k_THD, v_THD, plan, scale, kv_index)
        _count(stats, "fwd", sent)
        fctx.save_for_backward(q_THD, k_THD, v_THD, out_THD, lse_HT)
        fctx.ring = (plan, scale, kv_index, stats)
        return out_THD

    @staticmethod
    def backward(fctx: Any, do_THD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan, scale, kv_index, stats = fctx.ring
        dq, dk, dv, sent = _ring_backward(do_THD.contiguous(), *fctx.saved_tensors, plan, scale, kv_index)
        _count(stats, "bwd", sent)
        return dq, dk, dv, None, None, None, None


def _check_inputs(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, plan: RingPlan,
                  kv_index: torch.Tensor | None) -> None:
    Tr = plan.local_len
    if q_THD.dim() != 3 or q_THD.shape[0] != Tr:
        raise ValueError(
            f"q has shape {tuple(q_THD.shape)}; expected [Tr={Tr}, hq, D] (T={plan.total_len}, ring={plan.ring_size})"
        )
    hq, D = q_THD.shape[1], q_THD.shape[2]
    for name, x in (("k", k_THD), ("v", v_THD)):
        if x.dim() != 3 or x.shape[0] != Tr or x.shape[2] != D or x.shape[1] != k_THD.shape[1]:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [Tr={Tr}, hkv, D={D}] like k")
        if x.dtype != q_THD.dtype or x.device != q_THD.device:
            raise ValueError(
                f"{name} is {x.dtype} on {x.device}, q is {q_THD.dtype} on {q_THD.device}; they must match"
            )
    hkv = k_THD.shape[1]
    if kv_index is None:
        if hq and (hkv == 0 or hq % hkv != 0):
            raise ValueError(f"hq={hq} is not a multiple of hkv={hkv}; pass kv_index (the kv head of each q head)")
        return
    # values are checked on CPU only: on an accelerator that would be a host sync per layer
    on_cpu = kv_index.device.type == "cpu" and hq > 0
    if kv_index.shape != (hq,) or (on_cpu and not 0 <= int(kv_index.min()) <= int(kv_index.max()) < hkv):
        raise ValueError(f"kv_index={kv_index.tolist()} must hold hq={hq} kv head indices in [0, {hkv})")


def ring_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, plan: RingPlan, scale: float,
                   kv_index: torch.Tensor | None = None, stats: object | None = None) -> torch.Tensor:
    """Exact causal varlen attention over the whole stream for this ring group's heads.

    q [Tr, hq, D], k/v [Tr, hkv, D] (this rank's zigzag tokens) -> o [Tr, hq, D]. `kv_index` (int64
    [hq]) is the local kv head each local q head reads; None means q head h reads h // (hq // hkv).
    `stats` (optional) gets ring_bytes_fwd/bwd and ring_calls_fwd/bwd incremented (bytes sent).
    """
    _check_inputs(q_THD, k_THD, v_THD, plan, kv_index)
    if q_THD.shape[1] == 0:  # no heads on this ring group: nothing to exchange, keep the graph connected
        return q_THD * 0.0
    hq, hkv = q_THD.shape[1], k_THD.shape[1]
    if kv_index is None and hq != hkv:
        kv_index = torch.arange(hq, device=q_THD.device) // (hq // hkv)
    elif kv_index is not None:
        kv_index = kv_index.to(device=q_THD.device, dtype=torch.int64)
    q_THD, k_THD, v_THD = q_THD.contiguous(), k_THD.contiguous(), v_THD.contiguous()
    return _RingAttention.apply(q_THD, k_THD, v_THD, plan, scale, kv_index, stats)
