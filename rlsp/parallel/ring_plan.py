"""The static plan of ring attention for one packed micro-batch: where each token sits on the ring and,
per step, which (query, key) boxes are visible. Built once per micro-batch, shared by every layer, with
no communication.

Token placement (zigzag, for causal load balance): the stream of T tokens is cut into 2r equal chunks
and ring rank i holds chunks i and 2r-1-i, in that order (`zigzag_indices`). At step s a rank holds the
K/V block of ring rank (i - s) mod r; visibility (same segment of cu_seqlens, key position <= query
position) depends only on the step, so `RingPlan` caches, per step, one `StepBlock` per segment present
on both sides, keeping only 1-D positions and segment ids (O(Tr) per step); the mask of any row range
is derived from them, and the box is split on the host into full and square-causal tiles for the fused
kernels (rlsp/parallel/ring_tiles.py). Attention never crosses segments, so a packed stream of many rollouts costs the
sum of their squares; a step with no visible pair has no box.

Legend: T stream length, r ring size, Tr = T / r tokens of this rank, Q / K query / key rows of a box.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlsp.parallel.ring_tiles import Tile, split_box


def zigzag_indices(total_len: int, ring_size: int, ring_rank: int) -> torch.Tensor:
    """int64 stream positions held by `ring_rank`: chunk i, then chunk 2r-1-i, of 2r equal chunks."""
    if ring_size < 1 or not 0 <= ring_rank < ring_size:
        raise ValueError(
            f"ring_rank={ring_rank} with ring_size={ring_size}; need ring_size >= 1 and 0 <= ring_rank < ring_size"
        )
    if ring_size == 1:
        return torch.arange(total_len, dtype=torch.int64)
    if total_len < 0 or total_len % (2 * ring_size) != 0:
        raise ValueError(
            f"total_len={total_len} is not a multiple of 2*ring_size={2 * ring_size}; pad the packed stream "
            f"to a multiple of 2 * ring_size * ulysses_size"
        )
    chunk = total_len // (2 * ring_size)
    first, second = ring_rank * chunk, (2 * ring_size - 1 - ring_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


ROW_CHUNK = 1024  # query rows per score tile of the explicit path (rlsp/parallel/ring_reference.py)


@dataclass
class StepBlock:
    """Visible part of one step's (local queries x visiting keys) block for one segment: rows [q0, q1),
    keys [k0, k1). Only 1-D metadata is kept; the mask of any row range is derived from it, so a long
    sequence never holds a [Q, K] mask."""

    q0: int
    q1: int
    k0: int
    k1: int
    segment: int
    pos_Q: torch.Tensor  # stream positions and segment ids of the rows and keys of the box
    pos_K: torch.Tensor
    seg_Q: torch.Tensor
    seg_K: torch.Tensor
    tiles: tuple[Tile, ...] = ()  # full and square-causal tiles covering the box (rlsp/parallel/ring_tiles.py)

    def mask(self, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """bool [rows, K]: key visible to query (same segment, not in its future), rows r0:r1 of the box."""
        pos_R, seg_R = self.pos_Q[r0:r1], self.seg_Q[r0:r1]
        return ((seg_R[:, None] == self.segment) & (self.seg_K[None, :] == self.segment)
                & (self.pos_K[None, :] <= pos_R[:, None]))

    @property
    def mask_QK(self) -> torch.Tensor:
        return self.mask()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pos_Q, self.pos_K, self.seg_Q, self.seg_K))


@dataclass
class RingPlan:
    """Ring group and stream metadata of one micro-batch, shared by every layer (no communication)."""

    group: dist.ProcessGroup | None  # the K/V blocks travel on it
    ring_size: int
    ring_rank: int
    cu_seqlens: torch.Tensor
    total_len: int
    positions_RT: torch.Tensor = field(repr=False)  # int64 [r, Tr]: stream positions held by each ring rank
    segment_T: torch.Tensor = field(repr=False)  # int64 [T]: segment id of each stream position
    next_peer: int = 0  # global ranks of ring rank i+1 and i-1
    prev_peer: int = 0
    cache: dict[str, list[list[StepBlock]]] = field(default_factory=dict, repr=False)
    # the dK/dV accumulators' communicator: the same ranks as `group`, its own NCCL communicator (None: `group`)
    dkv_group: dist.ProcessGroup | None = None

    @property
    def grad_group(self) -> dist.ProcessGroup | None:
        """The group the dK/dV accumulators travel on in backward (see rlsp/parallel/ring.py)."""
        return self.group if self.dkv_group is None else self.dkv_group

    @property
    def local_len(self) -> int:
        """Tr: tokens held by this ring rank."""
        return self.total_len // self.ring_size

    def source_rank(self, step: int) -> int:
        """Ring rank whose K/V block this rank holds at `step`."""
        return (self.ring_rank - step) % self.ring_size

    def step_blocks(self, device: torch.device) -> list[list[StepBlock]]:
        """Per step, the visible blocks (none: fully masked, skip). Built once per device, then cached."""
        key = str(device)
        if key not in self.cache:
            self.cache[key] = [self._build_step(s, device) for s in range(self.ring_size)]
        return self.cache[key]

    def _build_step(self, step: int, device: torch.device) -> list[StepBlock]:
        """One box per segment present on both sides: attention never crosses segments, so a packed
        stream of many short sequences costs the sum of their squares, not the square of their sum."""
        pos_q, pos_k = self.positions_RT[self.ring_rank], self.positions_RT[self.source_rank(step)]
        seg_q, seg_k = self.segment_T[pos_q], self.segment_T[pos_k]
        blocks = []
        for seg in sorted(set(seg_q.tolist()) & set(seg_k.tolist())):
            in_q, in_k = seg_q == seg, seg_k == seg
            # rows that see some key (at or after the segment's first key here) and keys some row sees
            rows = (in_q & (pos_q >= pos_k[in_k].min())).nonzero().flatten()
            cols = (in_k & (pos_k <= pos_q[in_q].max())).nonzero().flatten()
            if rows.numel() == 0:
                continue
            q0, q1, k0, k1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
            tiles = split_box(pos_q[q0:q1], pos_k[k0:k1], q0, k0)  # on the host: no device sync per layer
            blocks.append(StepBlock(q0, q1, k0, k1, seg, *(t.to(device) for t in (
                pos_q[q0:q1], pos_k[k0:k1], seg_q[q0:q1], seg_k[k0:k1])), tiles))
        return blocks


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total_len: int) -> list[int]:
    cu = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else None
    if cu is None or len(cu) < 2 or cu[0] != 0 or cu[-1] != total_len or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(
            f"cu_seqlens={cu_seqlens.tolist()} must be a non-decreasing 1-D sequence from 0 to total_len={total_len} "
            "(segments cover the whole stream, padding tail included)"
        )
    return cu


def _check_dkv_group(group: dist.ProcessGroup | None, dkv_group: dist.ProcessGroup | None) -> None:
    """`dkv_group` must hold the ring's ranks in the ring's order (peers are global ranks of both)."""
    if dkv_group is None:
        return
    ring = [] if group is None else dist.get_process_group_ranks(group)
    other = dist.get_process_group_ranks(dkv_group)
    if group is None or other != ring or dkv_group is group:
        raise ValueError(f"dkv_group has global ranks {other}, the ring group {ring or None}: it must be a second "
                         "group over the same ranks in the same order (rlsp.parallel.mesh.ParallelDims.ring_dkv_group)")


def build_ring_plan(group: dist.ProcessGroup | None, cu_seqlens: torch.Tensor, total_len: int,
                    dkv_group: dist.ProcessGroup | None = None) -> RingPlan:
    """Plan for one packed micro-batch; `group=None` means ring_size 1 (one local block, no communication).
    `dkv_group` (optional) carries the backward's dK/dV accumulators on a communicator of their own."""
    _check_dkv_group(group, dkv_group)
    ring_size = 1 if group is None else dist.get_world_size(group)
    ring_rank = 0 if group is None else dist.get_rank(group)
    cu = _check_cu_seqlens(cu_seqlens, total_len)
    positions_RT = torch.stack([zigzag_indices(total_len, ring_size, i) for i in range(ring_size)])
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])], dtype=torch.int64)
    segment_T = torch.repeat_interleave(torch.arange(len(cu) - 1), lengths)
    peers = (0, 0)
    if group is not None:
        peers = tuple(dist.get_global_rank(group, (ring_rank + d) % ring_size) for d in (1, -1))
    return RingPlan(group=group, ring_size=ring_size, ring_rank=ring_rank, cu_seqlens=cu_seqlens,
                    total_len=total_len, positions_RT=positions_RT, segment_T=segment_T,
                    next_peer=peers[0], prev_peer=peers[1], dkv_group=dkv_group)
