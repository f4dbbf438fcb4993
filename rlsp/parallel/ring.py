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
saved. A step whose plan has no visible box is skipped (on full layers its block still travels). The backward runs
this ring once per head group (rlsp/parallel/ring_heads.py: G = hkv / n passes of n kv heads and their
q heads, n from the accumulators' byte bound; G = 1 for all but large problems), so its fp32 (fp64)
accumulators and K/V blocks in flight exist for one group at a time (step math: ring_grads.py).

Bytes SENT by a rank per call (r > 1; nothing when r == 1), e_in = element size of q/k/v,
e_acc = 4 (8 for fp64 inputs):
  forward:  (r-1) * 2*Tr*hkv*D * e_in                  (K and V in one buffer, hkv heads only)
  backward: (r-1) * 2*Tr*hkv*D * (e_in + e_acc)        (K/V again, plus the dK/dV accumulators)
The dK/dV accumulator of block j starts at rank j+1 and ends at j (r-1 hops); j adds its own part. With G head
groups the backward sends the same bytes in G * 2*(r-1) batches of 1/G the size.

Why sends and receives match on NCCL. NCCL ignores tags: between two ranks of one communicator the
k-th send of i to j meets the k-th receive of j from i, whatever their sizes. Two guarantees:
- Separate communicators. The dK/dV accumulators travel on `plan.grad_group`: the plan's `dkv_group`
  when it was built with one (`build_ring_plan(..., dkv_group=ParallelDims.ring_dkv_group)`, a second
  group over the ring's ranks created once with the meshes), so K/V blocks and accumulators never
  share a communicator's queue, whatever order they are issued in; else the ring group itself.
- The same program on every rank. Each communicator's ops are issued by a loop whose shape depends
  only on the ring size and the shapes, never on the data, the plan's boxes or the rank: forward,
  steps 0..r-2 each post one batch (send to i+1, receive from i-1) of the same [2, Tr, hkv, D] K/V
  buffer; backward, per head group (equal on every rank of a ring: they follow from the shapes) the
  same K/V batches of the group's heads at steps 0..r-2 and, at steps 1..r-1, one batch of its
  dK/dV accumulator in fp32 (fp64). A step without a visible box still posts its batches, and a rank whose
  ring group has no heads returns before any (every rank of a ring group holds the same heads). So
  i's sends to j and j's receives from i are the same sequence, in order and shape, on each group,
  and also when both passes share one group (`dkv_group=None`: K/V then accumulator within a step on
  every rank); every rank of the group posts every batch, the first one included, as NCCL requires of
  a group's first batched call. tests/distributed/test_ring_order.py records each rank's ops on
  gloo at ring 2 and 4 and checks exactly this.
Both communicators issue in the same order on every rank (K/V first in each step), so concurrent
kernels of the two cannot wait on each other in opposite orders.

Block math. Each box of the plan is split on the host into full and square-causal tiles
(rlsp/parallel/ring_tiles.py) and each tile runs a fused attention kernel that returns its output and
log-sum-exp (rlsp/parallel/ring_block.py: the CPU flash kernel, CUDA's memory-efficient kernel);
backward runs the kernel's flash backward per tile with the rows' FINAL output and lse, exact for
blockwise attention. The working set is O(rows x heads x D) plus the kernels' own small tiles, never
rows x keys scores. A dtype the device's kernel lacks (fp64 on CUDA) takes the explicit path
(rlsp/parallel/ring_reference.py: fp32/fp64 scores of ROW_CHUNK query rows of a box at a time).

Sliding-window and soft-capped layers (Gemma 2 / 3: `window`, `softcap`). The window is part of each box's
visibility (rlsp/parallel/ring_plan.py: query p sees key c of its segment when p - window < c <= p), so a box
holds only rows and keys the window connects, and a step whose visiting block lies wholly outside every
row's window has no box: it is not computed (`RingPlan.block_counts`; optional stats counters
ring_blocks_computed / ring_blocks_skipped). Soft-capping maps each scaled score s to cap * tanh(s / cap)
before the mask and softmax, forward and backward (d/ds = 1 - tanh^2(s / cap)). The fused kernels take
neither a band nor a cap, so these layers run the explicit path, a row chunk against its key band.
On windowed layers a K/V block no row of a rank sees is not sent to it either: when the plan's table of which
rank needs which step (`RingPlan.step_needs`, the same on every rank) has a gap, blocks go straight from their
owner to the ranks that need them and dK/dV parts straight back (rlsp/parallel/ring_direct.py, counters
ring_blocks_not_sent / ring_bytes_not_sent); full layers, and windowed ones whose every step is needed, relay.
Multi-latent attention (DeepSeek-V2/V3: v's head dim Dv differs from q/k's Dk): the K/V block is one buffer with k
and v side by side on the last dim (rlsp/parallel/ring_grads.py `pack_kv`), 2*Tr*hkv*D above reading
Tr*hkv*(Dk + Dv); the fused kernels zero-pad per tile (rlsp/parallel/ring_block.py).
Attention sinks (gpt-oss) join the merged rows once, after the last step (rlsp/parallel/ring_sinks.py).

Legend: T stream length, r ring size, Tr = T / r tokens of this rank, Q / K query / key rows of one block (its
bounding box), H heads (hq for q and o, hkv for k and v), D head dim (Dk of q and k, Dv of v).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlsp.parallel import ring_direct
from rlsp.parallel.ring_block import fused_supported, native_gqa
from rlsp.parallel.ring_checks import check_inputs, check_softcap
from rlsp.parallel.ring_grads import BlockCtx as _Ctx
from rlsp.parallel.ring_grads import attend as _attend
from rlsp.parallel.ring_grads import block_grads as _block_grads
from rlsp.parallel.ring_grads import pack_kv, split_kv
from rlsp.parallel.ring_heads import RING_BWD_ACC_BYTES, head_groups, kv_heads_per_pass
from rlsp.parallel.ring_plan import ROW_CHUNK, RingPlan
from rlsp.parallel.ring_reference import acc_dtype as _acc_dtype
from rlsp.parallel.ring_sinks import apply_sinks, check_sinks, sink_grad
from rlsp.parallel.ring_stats import count_blocks, count_sent, count_unsent, relay_bytes

__all__ = ["ROW_CHUNK", "ring_attention"]

_KV_TAG, _DKV_TAG = 0, 1


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


def _ring_forward(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, plan: RingPlan,
                  ctx: _Ctx, sinks_H: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (out [Tr, hq, Dv] in q's dtype, lse [hq, Tr] fp32/fp64, bytes sent). A step without a visible box
    (e.g. a block wholly outside every row's window) computes nothing; on a windowed layer a block no rank
    needs is not sent either (rlsp/parallel/ring_direct.py). Sinks join the merged rows once, after the last
    step (rlsp/parallel/ring_sinks.py)."""
    if ring_direct.applies(plan, ctx.window):
        out_THD, lse_HT, sent = ring_direct.forward(q_THD, k_THD, v_THD, plan, ctx)
    else:
        out_THD, lse_HT, sent = _relay_forward(q_THD, k_THD, v_THD, plan, ctx)
    if sinks_H is not None:
        out_THD, lse_HT = apply_sinks(out_THD, lse_HT, sinks_H)
    return out_THD.to(q_THD.dtype), lse_HT, sent


def _relay_forward(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, plan: RingPlan,
                   ctx: _Ctx) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every K/V block passed on at every step -> (out [Tr, hq, Dv] fp32/fp64, lse [hq, Tr], bytes sent)."""
    acc, (Tr, hq) = _acc_dtype(q_THD.dtype), q_THD.shape[:2]
    out_THD = q_THD.new_zeros((Tr, hq, v_THD.shape[2]), dtype=acc)
    lse_HT = q_THD.new_full((hq, Tr), float("-inf"), dtype=acc)
    kv_2THD, sent = pack_kv(k_THD, v_THD), 0
    for step, blocks in enumerate(plan.step_blocks(q_THD.device, ctx.window)):
        works, next_2THD, nbytes = _pass_kv(plan, step, kv_2THD)  # pass the block on while computing with it
        sent += nbytes
        for block in blocks:
            _attend(q_THD, kv_2THD, block, ctx, out_THD, lse_HT)
        _wait(works)
        kv_2THD = next_2THD
    return out_THD, lse_HT, sent


def _ring_backward(do_THD: torch.Tensor, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
                   out_THD: torch.Tensor, lse_HT: torch.Tensor, plan: RingPlan,
                   ctx: _Ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """-> (dq, dk, dv in the inputs' dtypes, bytes sent)."""
    if ring_direct.applies(plan, ctx.window):
        return ring_direct.backward(do_THD, q_THD, k_THD, v_THD, out_THD, lse_HT, plan, ctx)
    acc = lse_HT.dtype
    # the fused backward derives delta = rowsum(dO * O) itself from the final output
    delta_HT = None if ctx.fused else (do_THD.to(acc) * out_THD.to(acc)).sum(dim=-1).T.contiguous()
    saved = (out_THD, lse_HT, delta_HT, ctx)
    dq_THD = q_THD.new_zeros(q_THD.shape, dtype=acc)
    kv_2THD, sent, own_2THD, dkv_works, dkv_recv = pack_kv(k_THD, v_THD), 0, None, None, None
    for step, blocks in enumerate(plan.step_blocks(q_THD.device, ctx.window)):
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
    dk_THD, dv_THD = split_kv(own_2THD, ctx.k_dim)
    return dq_THD.to(q_THD.dtype), dk_THD.to(k_THD.dtype), dv_THD.to(v_THD.dtype), sent


def _grouped_backward(do_THD: torch.Tensor, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
                      out_THD: torch.Tensor, lse_HT: torch.Tensor, plan: RingPlan,
                      ctx: _Ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The ring backward one head group after another (rlsp/parallel/ring_heads.py): the fp32 (fp64)
    accumulators and K/V blocks in flight exist for one group at a time -> (dq, dk, dv, bytes sent)."""
    hq, hkv = q_THD.shape[1], k_THD.shape[1]
    groups = head_groups(hq, hkv, ctx.kv_per_pass or hkv)
    if len(groups) == 1:
        return _ring_backward(do_THD, q_THD, k_THD, v_THD, out_THD, lse_HT, plan, ctx)
    # groups exist only in the standard order, so a group's q head i reads its kv head i // (hq / hkv):
    # the first hq / G entries of the indices
    hq_g = groups[0].q.stop
    gctx = ctx._replace(kv_index=None if ctx.kv_index is None else ctx.kv_index[:hq_g],
                        kernel_index=None if ctx.kernel_index is None else ctx.kernel_index[:hq_g])
    dq_THD, dk_THD, dv_THD = (torch.empty_like(x) for x in (q_THD, k_THD, v_THD))
    sent = 0
    for qs, ks in groups:  # views: the kernels read strided heads, the K/V block is stacked per group
        dq_THD[:, qs], dk_THD[:, ks], dv_THD[:, ks], nbytes = _ring_backward(
            do_THD[:, qs], q_THD[:, qs], k_THD[:, ks], v_THD[:, ks], out_THD[:, qs], lse_HT[qs], plan, gctx)
        sent += nbytes
    return dq_THD, dk_THD, dv_THD, sent


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
                sinks_H: torch.Tensor | None, plan: RingPlan, ctx: _Ctx, stats: Any) -> torch.Tensor:
        out_THD, lse_HT, sent = _ring_forward(q_THD, k_THD, v_THD, plan, ctx, sinks_H)
        count_sent(stats, "fwd", sent)  # the stats counters: rlsp/parallel/ring_stats.py
        count_blocks(stats, plan, ctx.window)
        count_unsent(stats, plan, relay_bytes(plan, k_THD, v_THD, backward=False), sent)
        fctx.save_for_backward(q_THD, k_THD, v_THD, out_THD, lse_HT, sinks_H)
        fctx.ring = (plan, ctx, stats)
        return out_THD

    @staticmethod
    def backward(fctx: Any, do_THD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan, ctx, stats = fctx.ring
        *saved, sinks_H = fctx.saved_tensors
        do_THD = do_THD.contiguous()
        dq, dk, dv, sent = _grouped_backward(do_THD, *saved, plan, ctx)  # with the final (sink-merged) out, lse
        count_sent(stats, "bwd", sent)
        count_unsent(stats, plan, relay_bytes(plan, saved[1], saved[2], backward=True), sent)
        dsinks = None if sinks_H is None or not fctx.needs_input_grad[3] else sink_grad(do_THD, *saved[3:], sinks_H)
        return dq, dk, dv, dsinks, None, None, None


def ring_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, plan: RingPlan, scale: float,
                   kv_index: torch.Tensor | None = None, stats: object | None = None,
                   acc_bytes_bound: int = RING_BWD_ACC_BYTES, window: int | None = None,
                   softcap: float | None = None, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """Exact causal varlen attention over the whole stream for this ring group's heads; `window` (query p sees
    keys p - window < c <= p of its segment) and `softcap` (scores -> softcap * tanh(scores / softcap)) for
    sliding-window and soft-capped layers (explicit path); `sinks_H` [hq] (gpt-oss: a learned logit per q head
    in the softmax's denominator, applied once after the merge: rlsp/parallel/ring_sinks.py; gets a gradient).

    q/k [Tr, hq/hkv, Dk], v [Tr, hkv, Dv] (this rank's zigzag tokens; Dv != Dk for multi-latent attention)
    -> o [Tr, hq, Dv]. `kv_index` (int64
    [hq]) is the local kv head each local q head reads; None means q head h reads h // (hq // hkv).
    `stats` (optional) gets ring_bytes_fwd/bwd and ring_calls_fwd/bwd incremented (bytes sent), the block
    counters and ring_bytes_not_sent (what direct sends saved against the relay).
    The backward runs over head groups whose fp32 accumulators fit `acc_bytes_bound` bytes
    (rlsp/parallel/ring_heads.py; one group unless the problem is large, or kv_index is given).
    """
    check_inputs(q_THD, k_THD, v_THD, plan, kv_index)
    check_sinks(sinks_H, q_THD.shape[1])
    kv_per_pass = kv_heads_per_pass(plan.local_len, q_THD.shape[1], k_THD.shape[1], max(q_THD.shape[2], v_THD.shape[2]),
                                    _acc_dtype(q_THD.dtype).itemsize, acc_bytes_bound, standard=kv_index is None)
    if q_THD.shape[1] == 0:  # no heads on this ring group: nothing to exchange, keep the graph connected
        return q_THD.sum() * q_THD.new_zeros((q_THD.shape[0], 0, v_THD.shape[2]))
    hq, hkv, device = q_THD.shape[1], k_THD.shape[1], q_THD.device
    kernel_index = kv_index
    if kv_index is None and hq != hkv:
        kv_index = torch.arange(hq, device=device) // (hq // hkv)
        kernel_index = None if native_gqa(device) else kv_index  # the kernel reads grouped heads itself
    elif kv_index is not None:
        kv_index = kernel_index = kv_index.to(device=device, dtype=torch.int64)
    q_THD, k_THD, v_THD = q_THD.contiguous(), k_THD.contiguous(), v_THD.contiguous()
    check_softcap(softcap)
    fused = fused_supported(device, q_THD.dtype) and window is None and softcap is None  # kernels: no band, no cap
    k_dim = None if k_THD.shape[2] == v_THD.shape[2] else k_THD.shape[2]  # K/V side by side (ring_grads.pack_kv)
    ctx = _Ctx(scale, kv_index, kernel_index, fused, kv_per_pass, ROW_CHUNK, window, softcap, k_dim)
    return _RingAttention.apply(q_THD, k_THD, v_THD, sinks_H, plan, ctx, stats)
