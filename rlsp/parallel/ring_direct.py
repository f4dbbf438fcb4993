"""Ring attention of windowed layers with K/V blocks sent only where some row sees them ("direct" sends).

The relay of rlsp/parallel/ring.py passes every K/V block on at every step: at step s ring rank i holds the
block of rank (i - s) mod r because it came through i-1. With a sliding window shorter than a zigzag chunk most
of those blocks are seen by no row of the rank holding them (`RingPlan.step_blocks(window)` has no box), yet they
travel, because a later step may need the block behind them. Here each block goes straight from its owner to
the rank that needs it: at step s, rank i receives the block of i - s iff it has a box at step s, and sends its
own block to i + s iff that rank has one. The table `RingPlan.step_needs(window)` holds this for every rank of
the ring, derived from metadata every rank holds, so all ranks agree on every send and receive without a
message. Backward does the same for the K/V blocks, and returns each step's dK/dV part straight to the block's
owner (on `plan.grad_group`), which sums its parts; a part nobody computed is not sent.

Taken only for windowed layers whose table has a False entry (`applies`); otherwise the relay runs unchanged.
With one long sequence, a window shorter than a chunk and zigzag placement, a chunk's rows see only their own
chunk and the tail of the one before it, so rank i needs at most steps 0, 1 (chunk i-1 on rank i-1) and r-1
(chunk 2r-2-i on rank i+1), ranks 0 and r-1 fewer: of the relay's r(r-1) block sends per call, 2r-2 remain
(one per chunk boundary between ranks): 6 of 12 at r = 4, 14 of 56 at r = 8, none saved at r = 2.

Why sends and receives match (NCCL ignores tags and pairs the k-th send of a to b with the k-th receive of b
from a): the transfer a -> b of K/V happens only at step (b - a) mod r, that of dK/dV only at step (a - b) mod r,
each at most once per call (per head group), and both sides decide it from the same table in the same loop
iteration, posting K/V before dK/dV. Ranks post a batch only where they have ops; on NCCL a group's FIRST batched
call must include every rank, so a ring group whose first use is such a call needs its communicator created
eagerly (the relay layers of the same model use the group first in the usual case).

Legend: Tr tokens of this rank, r ring size, hq / hkv heads, D head dim (Dk of q/k, Dv of v).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlsp.parallel.ring_grads import BlockCtx, attend, block_grads, pack_kv, split_kv
from rlsp.parallel.ring_plan import RingPlan
from rlsp.parallel.ring_reference import acc_dtype

_KV_TAG, _DKV_TAG = 0, 1
Needs = tuple[tuple[bool, ...], ...]
Pending = tuple[list[dist.Work], torch.Tensor | None, torch.Tensor | None]  # works, receive buffer, send buffer


def applies(plan: RingPlan, window: int | None) -> bool:
    """Whether a layer with this window runs with direct sends: some rank has no box at some step."""
    return window is not None and plan.ring_size > 1 and not all(all(row) for row in plan.step_needs(window))


def unsent_blocks(plan: RingPlan, window: int | None) -> int:
    """K/V blocks this rank does not send in one forward call, against the relay's r - 1."""
    if not applies(plan, window):
        return 0
    needs, r, i = plan.step_needs(window), plan.ring_size, plan.ring_rank
    return sum(1 for s in range(1, r) if not needs[(i + s) % r][s])


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _exchange(plan: RingPlan, send: torch.Tensor | None, to: int, recv_like: torch.Tensor | None, frm: int,
              group: dist.ProcessGroup | None, tag: int) -> tuple[list[dist.Work], torch.Tensor | None, int]:
    """Send `send` to ring offset `to` and/or receive a tensor like `recv_like` from offset `frm` (None: not that
    side) -> (works, receive buffer or None, bytes sent)."""
    ops, recv = [], None
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, plan.peer(to), group, tag))
    if recv_like is not None:
        recv = torch.empty_like(recv_like)
        ops.append(dist.P2POp(dist.irecv, recv, plan.peer(frm), group, tag))
    sent = 0 if send is None else send.numel() * send.element_size()
    return (dist.batch_isend_irecv(ops) if ops else []), recv, sent


def _fetch(plan: RingPlan, needs: Needs, step: int,
           own: torch.Tensor) -> tuple[list[dist.Work], torch.Tensor | None, int]:
    """Post step `step`'s K/V transfers: own block to i + step if it needs it, i - step's block if this rank does."""
    r, i = plan.ring_size, plan.ring_rank
    if step >= r:
        return [], None, 0
    send = own if needs[(i + step) % r][step] else None
    return _exchange(plan, send, step, own if needs[i][step] else None, -step, plan.group, _KV_TAG)


def forward(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, plan: RingPlan,
            ctx: BlockCtx) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (out [Tr, hq, Dv] in the accumulation dtype, lse [hq, Tr], bytes sent); the next step's block is
    fetched while this one is computed."""
    needs, acc = plan.step_needs(ctx.window), acc_dtype(q_THD.dtype)
    Tr, hq = q_THD.shape[:2]
    out_THD = q_THD.new_zeros((Tr, hq, v_THD.shape[2]), dtype=acc)
    lse_HT = q_THD.new_full((hq, Tr), float("-inf"), dtype=acc)
    own = pack_kv(k_THD, v_THD)
    works, held, sent = [], own, 0
    for step, blocks in enumerate(plan.step_blocks(q_THD.device, ctx.window)):
        next_works, next_held, nbytes = _fetch(plan, needs, step + 1, own)
        sent += nbytes
        _wait(works)
        for block in blocks:  # a step without boxes received nothing (held is None)
            attend(q_THD, held, block, ctx, out_THD, lse_HT)
        works, held = next_works, next_held
    return out_THD, lse_HT, sent


def backward(do_THD: torch.Tensor, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
             out_THD: torch.Tensor, lse_HT: torch.Tensor, plan: RingPlan,
             ctx: BlockCtx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """-> (dq, dk, dv in the inputs' dtypes, bytes sent): K/V fetched as in `forward`, each step's dK/dV part sent
    straight back to the block's owner."""
    needs, acc, r, i = plan.step_needs(ctx.window), lse_HT.dtype, plan.ring_size, plan.ring_rank
    delta_HT = None if ctx.fused else (do_THD.to(acc) * out_THD.to(acc)).sum(dim=-1).T.contiguous()
    saved = (out_THD, lse_HT, delta_HT, ctx)
    dq_THD = q_THD.new_zeros(q_THD.shape, dtype=acc)
    own = pack_kv(k_THD, v_THD)
    own_dkv = own.new_zeros(own.shape, dtype=acc)
    works, held, sent = [], own, 0
    pending: Pending | None = None
    for step, blocks in enumerate(plan.step_blocks(q_THD.device, ctx.window)):
        next_works, next_held, nbytes = _fetch(plan, needs, step + 1, own)
        sent += nbytes
        _wait(works)
        dkv = None if held is None else block_grads(do_THD, q_THD, held, blocks, saved, dq_THD)
        if step == 0 and dkv is not None:
            own_dkv += dkv
        elif step > 0:
            _drain(pending, own_dkv)  # the parts of the previous step, before this step's buffers exist
            recv_like = own_dkv if needs[(i + step) % r][step] else None
            dkv_works, recv, nbytes = _exchange(plan, dkv, -step, recv_like, step, plan.grad_group, _DKV_TAG)
            sent, pending = sent + nbytes, (dkv_works, recv, dkv)  # dkv kept alive until its send is done
        works, held = next_works, next_held
    _drain(pending, own_dkv)
    dk_THD, dv_THD = split_kv(own_dkv, ctx.k_dim)
    return dq_THD.to(q_THD.dtype), dk_THD.to(k_THD.dtype), dv_THD.to(v_THD.dtype), sent


def _drain(pending: Pending | None, own_dkv: torch.Tensor) -> None:
    """Wait for a step's dK/dV exchange and add the part received for this rank's block."""
    if pending is None:
        return
    works, recv, _ = pending
    _wait(works)
    if recv is not None:
        own_dkv += recv
