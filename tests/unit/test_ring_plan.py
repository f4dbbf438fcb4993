"""Ring attention without communication: zigzag placement, the per-step plan, the block math, and
ring_size=1 ring_attention against dense fp64 attention (values and q/k/v gradients, every element)."""

from __future__ import annotations

import pytest
import torch
from test_ring_block import _assert_close
from test_ring_block import tolerances as attention_tolerances

import rlsp.parallel.ring as ring_module
from rlsp.data.packing import pack_sequences
from rlsp.models.attention import ulysses_attention
from rlsp.parallel.ring import ring_attention
from rlsp.parallel.ring_plan import RingPlan, build_ring_plan, zigzag_indices
from rlsp.parallel.ring_reference import block_attention, block_attention_backward
from rlsp.parallel.ulysses import SPStats, build_sp_context

LENS = (7, 13, 1, 5, 10, 4)  # 40 tokens, the last segment stands for the padding tail


def _cu(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def dense_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T, T] bool: key b visible to query a iff same segment and b <= a."""
    seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    pos = torch.arange(total)
    return (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    kv_index: torch.Tensor) -> torch.Tensor:
    """Masked softmax over the full stream; q head h reads kv head kv_index[h]."""
    k, v = k.index_select(1, kv_index), v.index_select(1, kv_index)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1), v)


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4])
def test_zigzag_partitions_the_stream(ring_size: int) -> None:
    total = 2 * ring_size * 3
    parts = [zigzag_indices(total, ring_size, i) for i in range(ring_size)]
    assert all(p.dtype == torch.int64 and p.shape == (total // ring_size,) for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(total))
    chunk = total // (2 * ring_size)
    for i, p in enumerate(parts):
        if ring_size > 1:  # chunk i then chunk 2r-1-i
            assert p[:chunk].tolist() == list(range(i * chunk, (i + 1) * chunk))
            assert p[chunk:].tolist() == list(range((2 * ring_size - 1 - i) * chunk, (2 * ring_size - i) * chunk))


def test_zigzag_examples_and_errors() -> None:
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_indices(7, 1, 0).tolist() == list(range(7))
    with pytest.raises(ValueError, match=r"total_len=10 is not a multiple of 2\*ring_size=8"):
        zigzag_indices(10, 4, 0)
    with pytest.raises(ValueError, match="ring_rank=2 with ring_size=2"):
        zigzag_indices(8, 2, 2)
    with pytest.raises(ValueError, match="ring_size=0"):
        zigzag_indices(8, 0, 0)


def test_plan_rejects_bad_cu_seqlens() -> None:
    with pytest.raises(ValueError, match="total_len=12"):
        build_ring_plan(None, _cu((5, 5)), 12)
    with pytest.raises(ValueError, match="non-decreasing"):
        build_ring_plan(None, torch.tensor([0, 6, 4, 12]), 12)


def _plan_for(cu: torch.Tensor, total: int, ring_size: int, ring_rank: int) -> RingPlan:
    """A plan for one rank of a ring without a process group (metadata only)."""
    plan = build_ring_plan(None, cu, total)
    plan.ring_size, plan.ring_rank = ring_size, ring_rank
    plan.positions_RT = torch.stack([zigzag_indices(total, ring_size, i) for i in range(ring_size)])
    return plan


@pytest.mark.parametrize("lens", [LENS, (40,), (5, 5, 5, 5, 5, 5, 5, 5)])
@pytest.mark.parametrize("ring_size", [2, 4])
def test_step_masks_tile_the_dense_mask(lens: tuple[int, ...], ring_size: int) -> None:
    """Over all ranks and steps the cached boxes cover every visible pair of the stream exactly once."""
    total, cu = sum(lens), _cu(lens)
    covered = torch.zeros(total, total, dtype=torch.int64)
    for rank in range(ring_size):
        plan = _plan_for(cu, total, ring_size, rank)
        for step, blocks in enumerate(plan.step_blocks(torch.device("cpu"))):
            for block in blocks:
                rows = plan.positions_RT[rank][block.q0 : block.q1]
                cols = plan.positions_RT[plan.source_rank(step)][block.k0 : block.k1]
                covered[rows[:, None], cols[None, :]] += block.mask_QK.long()
        assert plan.step_blocks(torch.device("cpu")) is plan.step_blocks(torch.device("cpu"))  # cached per plan
    assert torch.equal(covered, dense_mask(cu, total).long())


def test_plan_skips_fully_masked_steps_and_halves_zigzag_blocks() -> None:
    # segments equal to the chunks: rank 0 (chunks 0, 3) never sees rank 1's keys (chunks 1, 2)
    blocks = _plan_for(_cu((2, 2, 2, 2)), 8, 2, 0).step_blocks(torch.device("cpu"))
    assert len(blocks[0]) == 2 and blocks[1] == []  # one box per own segment, none for the visitor
    # one causal sequence: the visiting block is half the queries (rank 0) or half the keys (rank 1)
    [b0] = _plan_for(_cu((16,)), 16, 2, 0).step_blocks(torch.device("cpu"))[1]
    [b1] = _plan_for(_cu((16,)), 16, 2, 1).step_blocks(torch.device("cpu"))[1]
    assert (b0.q0, b0.q1, b0.k0, b0.k1) == (4, 8, 0, 8) and bool(b0.mask_QK.all())
    assert (b1.q0, b1.q1, b1.k0, b1.k1) == (0, 8, 0, 4) and bool(b1.mask_QK.all())


def test_boxes_follow_segments_so_packed_work_is_the_sum_of_squares() -> None:
    """Eight 16-token rollouts packed in one stream: the boxes cover 16x16 per segment at most, never
    the 64x64 of a ring rank's whole share."""
    lens = (16,) * 8
    total = sum(lens)
    for rank in range(2):
        plan = _plan_for(_cu(lens), total, 2, rank)
        area = sum((b.q1 - b.q0) * (b.k1 - b.k0) for blocks in plan.step_blocks(torch.device("cpu")) for b in blocks)
        assert area <= 8 * 16 * 16 // 2 + 8 * 16, (rank, area)


def test_block_rows_without_keys_give_zeros_not_nans() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(3, 2, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    mask = torch.tensor([[True, False, False], [False, False, False], [True, True, False]])
    o, lse = block_attention(q, k, v, mask, 0.5)
    assert torch.isneginf(lse[:, 1]).all() and torch.equal(o[1], torch.zeros(2, 4, dtype=torch.float64))
    delta = (do * o).sum(-1).T
    grads = block_attention_backward(do, q, k, v, mask, 0.5, lse, delta)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert torch.equal(grads[0][1], torch.zeros(2, 4, dtype=torch.float64))


def _inputs(total: int, hq: int, hkv: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(total, hq, 8), (total, hkv, 8), (total, hkv, 8), (total, hq, 8)]  # q, k, v, upstream grad
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


@pytest.mark.parametrize("row_chunk", [1024, 3])  # 3: every box split into tiles of query rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hq, hkv, kv_index", [(4, 2, None), (3, 3, None), (3, 2, [0, 0, 1])])
def test_ring_size_one_matches_dense_reference(dtype: torch.dtype, hq: int, hkv: int, kv_index: list | None,
                                               row_chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ring_module, "ROW_CHUNK", row_chunk)
    total, cu, scale = sum(LENS), _cu(LENS), 8**-0.5
    q, k, v, do = _inputs(total, hq, hkv, dtype)
    index = torch.tensor(kv_index) if kv_index is not None else torch.arange(hq) // (hq // hkv)
    qr, kr, vr = (x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v))
    ref = dense_attention(qr, kr, vr, dense_mask(cu, total), scale, index)
    ref.backward(do.double())
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    stats = SPStats()  # the counters rlsp's attention passes to the ring
    kv_arg = torch.tensor(kv_index) if kv_index is not None else None
    out = ring_attention(qt, kt, vt, build_ring_plan(None, cu, total), scale, kv_arg, stats)
    out.backward(do)
    assert out.dtype == dtype and out.shape == (total, hq, 8)
    pairs = (("o", out, ref), ("dq", qt.grad, qr.grad), ("dk", kt.grad, kr.grad), ("dv", vt.grad, vr.grad))
    rtol_o, rtol_g = attention_tolerances(dtype)  # tests/tolerances.py, as test_ring_block derives them
    for name, got, want in pairs:
        _assert_close(name, got, want, rtol_o if name == "o" else rtol_g, f"({dtype})")
    assert (stats.ring_bytes_fwd, stats.ring_bytes_bwd, stats.ring_calls_fwd, stats.ring_calls_bwd) == (0, 0, 1, 1)


def test_ring_size_one_matches_packed_ulysses_attention() -> None:
    """The same stream through the existing packed attention (sp=1) gives the same output."""
    ids = torch.ones(len(LENS), max(LENS), dtype=torch.long)
    mask = (torch.arange(max(LENS))[None, :] < torch.tensor(LENS)[:, None]).long()
    packed = pack_sequences(ids, mask)
    q, k, v, _ = _inputs(packed.total_len, 4, 2, torch.float32, seed=3)
    ctx = build_sp_context(None, packed, 4, 2)
    layer = type("Layer", (torch.nn.Module,), {"layer_idx": 0})()
    want, _ = ulysses_attention(layer, *(x.transpose(0, 1)[None] for x in (q, k, v)), None, sp_context=ctx)
    got = ring_attention(q, k, v, build_ring_plan(None, packed.cu_seqlens, packed.total_len), 8**-0.5)
    _assert_close("o", got, want[0].double(), attention_tolerances(torch.float32)[0])  # two fp32 forwards


def test_ring_attention_rejects_bad_shapes() -> None:
    plan = build_ring_plan(None, _cu((6,)), 6)
    q, k = torch.zeros(6, 3, 8), torch.zeros(6, 2, 8)
    with pytest.raises(ValueError, match="hq=3 is not a multiple of hkv=2"):
        ring_attention(q, k, k, plan, 1.0)
    with pytest.raises(ValueError, match=r"kv_index=\[0, 2, 1\]"):
        ring_attention(q, k, k, plan, 1.0, torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match=r"expected \[Tr=6, hq, D\]"):
        ring_attention(q[:5], k, k, plan, 1.0)


def test_ring_group_without_heads_returns_connected_zeros() -> None:
    """Uneven Ulysses layouts can leave a ring group with no heads: an empty, graph-connected output."""
    q = torch.zeros(6, 0, 8, requires_grad=True)
    out = ring_attention(q, torch.zeros(6, 0, 8), torch.zeros(6, 0, 8), build_ring_plan(None, _cu((6,)), 6), 1.0)
    assert out.shape == (6, 0, 8) and out.requires_grad
