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

Sliding windows (`step_blocks(device, window)`, cached per window): query position p sees key position c of
its segment when p - window < c <= p. Boxes are cut to the rows that see some key and the keys some row sees
under that rule, so a step whose visiting block lies wholly outside every row's window has no box and is not
computed (`block_counts`); windowed boxes carry no tiles (the explicit path masks them, a row chunk against
its key band only: `StepBlock.key_band`), and a windowed segment gets one box per zigzag chunk of rows, so a
box's rows are consecutive positions and its bands stay about window + rows wide. `offline_plans` builds
every rank's plan without process groups (to count what a window skips before launching anything).

Sends of windowed layers (`step_needs(window)`): which ring rank has a box at which step, for EVERY rank of the
ring, from the stream metadata every rank holds; all ranks derive the same table, so they agree on which K/V
blocks travel (rlsp/parallel/ring_direct.py) without a message.

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
    window: int | None = None  # sliding window of the layer (None: plain causal)
    host_pos: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # pos_Q, pos_K on the host

    def mask(self, r0: int = 0, r1: int | None = None, k0: int = 0, k1: int | None = None) -> torch.Tensor:
        """bool [rows, keys]: key visible to query (same segment, not in its future, within the window), rows
        r0:r1 and keys k0:k1 of the box."""
        pos_R, seg_R, pos_C = self.pos_Q[r0:r1], self.seg_Q[r0:r1], self.pos_K[k0:k1]
        keep = ((seg_R[:, None] == self.segment) & (self.seg_K[None, k0:k1] == self.segment)
                & (pos_C[None, :] <= pos_R[:, None]))
        if self.window is not None:
            keep &= pos_C[None, :] > pos_R[:, None] - self.window
        return keep

    def key_band(self, r0: int, r1: int) -> tuple[int, int]:
        """Keys [k0, k1) of the box that rows r0:r1 can see (all of them without a window), from host positions:
        no device sync. Key positions of a box increase, so the band is one slice."""
        if self.window is None or self.host_pos is None:
            return 0, self.k1 - self.k0
        pos_R, pos_K = self.host_pos[0][r0:r1], self.host_pos[1]
        lo = int(torch.searchsorted(pos_K, pos_R[0] - self.window, right=True))
        hi = int(torch.searchsorted(pos_K, pos_R[-1], right=True))
        return lo, max(lo, hi)

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
    ring_ranks: tuple[int, ...] = ()  # global rank of each ring rank (empty without a process group)
    needs_cache: dict[str, tuple[tuple[bool, ...], ...]] = field(default_factory=dict, repr=False)

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

    def peer(self, offset: int) -> int:
        """Global rank of ring rank (i + offset) mod r."""
        return self.ring_ranks[(self.ring_rank + offset) % self.ring_size]

    def step_needs(self, window: int | None = None) -> tuple[tuple[bool, ...], ...]:
        """needs[i][s]: whether ring rank i has a visible pair with the K/V block it holds at step s (that of ring rank
        (i - s) mod r), for every rank of the ring; the same table on every rank, cached per window."""
        key = f"window={window}"
        if key not in self.needs_cache:
            start_T = self.cu_seqlens.to(torch.int64)[self.segment_T]  # first position of each token's segment
            low = -1 if window is None else window
            self.needs_cache[key] = tuple(
                tuple(_sees_any(self.positions_RT[i], self.positions_RT[(i - s) % self.ring_size], start_T, low)
                      for s in range(self.ring_size)) for i in range(self.ring_size))
        return self.needs_cache[key]

    def step_blocks(self, device: torch.device, window: int | None = None) -> list[list[StepBlock]]:
        """Per step, the visible blocks (none: fully masked, skip). Built once per device and window, then cached."""
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding window={window!r}; legal: a positive int (query p sees keys p-window < c <= p) "
                             "or None (plain causal)")
        key = str(device) if window is None else f"{device}|window={window}"
        if key not in self.cache:
            self.cache[key] = [self._build_step(s, device, window) for s in range(self.ring_size)]
        return self.cache[key]

    def block_counts(self, window: int | None = None) -> tuple[int, int]:
        """(steps whose visiting K/V block this rank computes, steps it skips: no visible pair) of one call."""
        computed = sum(1 for blocks in self.step_blocks(torch.device("cpu"), window) if blocks)
        return computed, self.ring_size - computed

    def _build_step(self, step: int, device: torch.device, window: int | None = None) -> list[StepBlock]:
        """One box per segment present on both sides: attention never crosses segments, so a packed
        stream of many short sequences costs the sum of their squares, not the square of their sum."""
        pos_q, pos_k = self.positions_RT[self.ring_rank], self.positions_RT[self.source_rank(step)]
        seg_q, seg_k = self.segment_T[pos_q], self.segment_T[pos_k]
        blocks = []
        for seg, in_q in self._row_sets(seg_q, seg_k, window):
            rows, cols = _visible(pos_q, pos_k, in_q, seg_k == seg, window)
            if rows.numel() == 0:
                continue
            q0, q1, k0, k1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
            # on the host: no device sync per layer; a windowed box is masked by the explicit path, no tiles
            tiles = split_box(pos_q[q0:q1], pos_k[k0:k1], q0, k0) if window is None else ()
            blocks.append(StepBlock(q0, q1, k0, k1, seg, *(t.to(device) for t in (
                pos_q[q0:q1], pos_k[k0:k1], seg_q[q0:q1], seg_k[k0:k1])), tiles, window,
                (pos_q[q0:q1], pos_k[k0:k1])))
        return blocks


    def _row_sets(self, seg_q: torch.Tensor, seg_k: torch.Tensor,
                  window: int | None) -> list[tuple[int, torch.Tensor]]:
        """(segment, its rows here) per box: one per segment on both sides; with a window, one per zigzag chunk of
        rows too, so each box's rows are consecutive positions and its row chunks' key bands stay narrow."""
        halves = [torch.ones_like(seg_q, dtype=torch.bool)]
        if window is not None and self.ring_size > 1:
            first = torch.arange(seg_q.numel()) < seg_q.numel() // 2
            halves = [first, ~first]
        return [(seg, (seg_q == seg) & half) for seg in sorted(set(seg_q.tolist()) & set(seg_k.tolist()))
                for half in halves]


def _visible(pos_q: torch.Tensor, pos_k: torch.Tensor, in_q: torch.Tensor, in_k: torch.Tensor,
             window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices of the rows that see some key of the segment, indices of the keys some row sees): key c is
    visible to row p iff p - window < c <= p (no lower bound without a window). Positions increase on each
    side, so counts of keys (rows) in a position range come from binary searches: O(Tr log Tr), no mask."""
    pq, pk = pos_q[in_q], pos_k[in_k]
    if pq.numel() == 0 or pk.numel() == 0:
        return pq.new_empty(0), pq.new_empty(0)
    w = pq.new_tensor(pos_q.numel() + pos_k.numel() + int(max(pq.max(), pk.max())) + 1 if window is None else window)
    # keys in (p - w, p] for each row p; rows in [c, c + w) for each key c
    sees = torch.searchsorted(pk, pos_q, right=True) > torch.searchsorted(pk, pos_q - w, right=True)
    seen = torch.searchsorted(pq, pos_k + w) > torch.searchsorted(pq, pos_k)
    return (in_q & sees).nonzero().flatten(), (in_k & seen).nonzero().flatten()


def _sees_any(pos_q: torch.Tensor, pos_k: torch.Tensor, start_T: torch.Tensor, window: int) -> bool:
    """Whether some row (positions pos_q) sees some key (positions pos_k, increasing) of its segment: keys in
    (max(p - window, start - 1), p] for a row p whose segment starts at `start` (window < 0: no window)."""
    if pos_q.numel() == 0 or pos_k.numel() == 0:
        return False
    lower = start_T[pos_q] - 1
    if window > 0:
        lower = torch.maximum(lower, pos_q - window)
    seen = torch.searchsorted(pos_k, pos_q, right=True) - torch.searchsorted(pos_k, lower, right=True)
    return bool((seen > 0).any())


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
    peers, ranks = (0, 0), ()
    if group is not None:
        ranks = tuple(dist.get_global_rank(group, i) for i in range(ring_size))
        peers = ranks[(ring_rank + 1) % ring_size], ranks[(ring_rank - 1) % ring_size]
    return RingPlan(group=group, ring_size=ring_size, ring_rank=ring_rank, cu_seqlens=cu_seqlens,
                    total_len=total_len, positions_RT=positions_RT, segment_T=segment_T,
                    next_peer=peers[0], prev_peer=peers[1], dkv_group=dkv_group, ring_ranks=ranks)


def offline_plans(cu_seqlens: torch.Tensor, total_len: int, ring_size: int) -> list[RingPlan]:
    """The plan of every rank of a ring of `ring_size`, without process groups (metadata only: block counts,
    boxes; nothing to run a ring with), e.g. to measure what a window skips before launching anything."""
    cu = _check_cu_seqlens(cu_seqlens, total_len)
    positions_RT = torch.stack([zigzag_indices(total_len, ring_size, i) for i in range(ring_size)])
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])], dtype=torch.int64)
    segment_T = torch.repeat_interleave(torch.arange(len(cu) - 1), lengths)
    return [RingPlan(group=None, ring_size=ring_size, ring_rank=i, cu_seqlens=cu_seqlens, total_len=total_len,
                     positions_RT=positions_RT, segment_T=segment_T) for i in range(ring_size)]
