"""Fused ring-attention blocks: the tiles a box splits into, and the fused kernels' forward (output,
lse) and backward (from the rows' final output and lse) against dense fp64 attention, every element.

The ring is simulated in one process: for every rank and step, the plan's tiles of the local rows x
the visiting rank's keys run `fused_forward`, merged by log-sum-exp, then `fused_backward` with the
merged output/lse; dq/dk/dv are scattered back to stream positions and compared with autograd of
dense attention over the packed stream (segments never attend across each other).

Tolerances (`tolerances` below, from tests/tolerances.py) are max abs errors at the scale of the reference's
largest element (inputs ~ N(0, 1), D = 8, scale D**-0.5, at most 40 keys per row). fp64 and fp32 kernels keep
the dtype through the scores, the log-sum-exp, the weighted values and the merge of blocks (4 reductions of at
most 40 terms; the backward's transposes double them). bf16 and fp16 kernels accumulate in fp32 and round what
they store to the dtype: the output once, a gradient as a sum of up to 40 rounded products. The reference gets
the inputs already rounded to the dtype. Measured on CPU: fp64 <= 0.17, fp32 <= 0.09, bf16 <= 0.35, fp16
<= 0.38 of these bounds; a tile lost, doubled or mis-masked is off by O(1e-1) or more.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import roundoff_rtol, scalar_tol

import rlsp.parallel.ring as ring_module
from rlsp.parallel import ring_tiles
from rlsp.parallel.ring import ring_attention
from rlsp.parallel.ring_block import fused_backward, fused_forward, fused_supported, native_gqa
from rlsp.parallel.ring_plan import RingPlan, build_ring_plan, zigzag_indices
from rlsp.parallel.ring_tiles import split_box
from rlsp.plan.memory import RING_TILE_TOKENS

D, SCALE = 8, 8**-0.5
KEYS = 40  # the longest row's keys: the longest reduction (D = 8 is shorter)


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(output rtol, gradient rtol) of the kernels in `dtype` against dense fp64 attention (module docstring)."""
    if dtype in (torch.float32, torch.float64):
        return roundoff_rtol(reduction=KEYS, stages=4, dtype=dtype), roundoff_rtol(reduction=KEYS, stages=8, dtype=dtype)
    return roundoff_rtol(reduction=1, stages=1, dtype=dtype), roundoff_rtol(reduction=KEYS, stages=1, dtype=dtype)


def _assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, rtol: float, where: str = "") -> None:
    err, tol = (got.double().cpu() - ref).abs().max().item(), scalar_tol(ref.abs().max().item(), rtol)
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g} {where}"
PACKED = (7, 13, 1, 5, 10, 4)  # 40 tokens: segment boundaries inside zigzag chunks, a 1-token segment


def _cu(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _segments(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


def _plan_for(lens: tuple[int, ...], ring_size: int, ring_rank: int) -> RingPlan:
    """A plan for one rank of a ring without a process group (metadata only)."""
    total = sum(lens)
    plan = build_ring_plan(None, _cu(lens), total)
    plan.ring_size, plan.ring_rank = ring_size, ring_rank
    plan.positions_RT = torch.stack([zigzag_indices(total, ring_size, i) for i in range(ring_size)])
    return plan


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: tuple[int, ...]) -> torch.Tensor:
    """fp64 causal attention within segments; q head h reads kv head h // (hq // hkv)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    seg, pos = _segments(lens), torch.arange(q.shape[0])
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k).mul(SCALE).masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("max_tile", [None, 3])
@pytest.mark.parametrize("lens", [PACKED, (40,), (5,) * 8, (16, 24)])
@pytest.mark.parametrize("ring_size", [1, 2, 4])
def test_tiles_cover_each_box_exactly_once(lens: tuple[int, ...], ring_size: int, max_tile: int | None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Full tiles are all visible, causal tiles are square with their diagonal at equal positions, and
    the tiles of a box add up to its mask (each visible pair once, nothing else); with a tile bound, no
    tile has more rows or keys than it."""
    if max_tile:
        monkeypatch.setattr(ring_tiles, "MAX_TILE", max_tile)
    for rank in range(ring_size):
        plan = _plan_for(lens, ring_size, rank)
        for step, blocks in enumerate(plan.step_blocks(torch.device("cpu"))):
            pos_q, pos_k = plan.positions_RT[rank], plan.positions_RT[plan.source_rank(step)]
            for block in blocks:
                covered = torch.zeros(block.q1 - block.q0, block.k1 - block.k0, dtype=torch.int64)
                for t in block.tiles:
                    assert max_tile is None or max(t.q1 - t.q0, t.k1 - t.k0) <= max_tile
                    rows, keys = pos_q[t.q0:t.q1], pos_k[t.k0:t.k1]
                    visible = keys[None, :] <= rows[:, None]
                    if t.causal:
                        assert t.q1 - t.q0 == t.k1 - t.k0 and torch.equal(rows, keys)
                        assert torch.equal(visible, torch.ones_like(visible).tril())
                    else:
                        assert bool(visible.all())
                    covered[t.q0 - block.q0:t.q1 - block.q0, t.k0 - block.k0:t.k1 - block.k0] += visible.long()
                assert torch.equal(covered, block.mask_QK.long()), (rank, step, block.tiles)


def test_zigzag_tiles_are_few() -> None:
    """One 16-token sequence on ring 2: the own block is 2 causal squares and 1 full tile (the late
    chunk's rows x the early chunk's keys); a visiting block is 1 full tile."""
    own = _plan_for((16,), 2, 0).step_blocks(torch.device("cpu"))[0][0].tiles
    assert sorted((t.q0, t.q1, t.k0, t.k1, t.causal) for t in own) == [
        (0, 4, 0, 4, True), (4, 8, 0, 4, False), (4, 8, 4, 8, True)]
    for rank in range(2):
        [visitor] = _plan_for((16,), 2, rank).step_blocks(torch.device("cpu"))[1]
        assert len(visitor.tiles) == 1 and not visitor.tiles[0].causal
    assert split_box(torch.tensor([3, 4, 9]), torch.tensor([10, 11]), 0, 0) == ()  # keys after every row


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, blk_lse: torch.Tensor) -> None:
    new = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new).T[..., None]).add_(o.double() * torch.exp(blk_lse - new).T[..., None])
    lse.copy_(new)


def _kernel_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """k/v as the device's kernel takes them: grouped heads as they are, or expanded to the q heads."""
    return x if native_gqa(x.device) else x.repeat_interleave(group, 1)


def _kv_grad(g: torch.Tensor, group: int, hkv: int) -> torch.Tensor:
    """An expanded gradient summed back over each kv head's group of q heads."""
    return g if g.shape[1] == hkv else g.unflatten(1, (hkv, group)).sum(2)


def _simulated_ring(q, k, v, do, lens: tuple[int, ...], ring_size: int) -> list[torch.Tensor]:
    """(o, dq, dk, dv) at stream positions (fp64, CPU) from the fused tiles of every rank and step."""
    out, lse = torch.zeros(q.shape, dtype=torch.float64), torch.full(q.shape[1::-1], float("-inf"), dtype=torch.float64)
    plans, group = [_plan_for(lens, ring_size, i) for i in range(ring_size)], q.shape[1] // k.shape[1]
    tiles = [(p.positions_RT[p.ring_rank], p.positions_RT[p.source_rank(s)], t) for p in plans
             for s, blocks in enumerate(p.step_blocks(torch.device("cpu"))) for b in blocks for t in b.tiles]
    for pos_q, pos_k, t in tiles:
        rows, keys = pos_q[t.q0:t.q1], pos_k[t.k0:t.k1]
        kt, vt = (_kernel_kv(x[keys.to(x.device)], group) for x in (k, v))
        o, blk_lse = fused_forward(q[rows.to(q.device)], kt, vt, t.causal, SCALE)
        assert o.dtype == q.dtype and blk_lse.shape == (q.shape[1], rows.numel())
        sub_out, sub_lse = out[rows], lse[:, rows]
        _merge(sub_out, sub_lse, o.cpu(), blk_lse.double().cpu())
        out[rows], lse[:, rows] = sub_out, sub_lse
    o_final, grads = out.to(q.dtype).to(q.device), [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    for pos_q, pos_k, t in tiles:
        rows, keys = pos_q[t.q0:t.q1], pos_k[t.k0:t.k1]
        r, c = rows.to(q.device), keys.to(q.device)
        dq, dk, dv = fused_backward(do[r], q[r], _kernel_kv(k[c], group), _kernel_kv(v[c], group), o_final[r],
                                    lse[:, rows].to(q.device), t.causal, SCALE)
        grads[0][rows] += dq.double().cpu()
        grads[1][keys] += _kv_grad(dk, group, k.shape[1]).double().cpu()
        grads[2][keys] += _kv_grad(dv, group, k.shape[1]).double().cpu()
    return [out, *grads]


def _check_fused_tiles(device: str, dtype: torch.dtype, lens: tuple[int, ...], ring_size: int, hq: int,
                       hkv: int) -> None:
    gen = torch.Generator().manual_seed(ring_size * 10 + hq)
    shapes = [(sum(lens), h, D) for h in (hq, hkv, hkv, hq)]
    # rounded to the dtype first: the reference sees the kernel's inputs exactly
    q, k, v, do = (torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).double() for s in shapes)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    want = _dense(qr, kr, vr, lens)
    want.backward(do)
    got = _simulated_ring(*(x.to(device=device, dtype=dtype) for x in (q, k, v, do)), lens, ring_size)
    rtol_o, rtol_g = tolerances(dtype)
    for name, g, w, rtol in zip(("o", "dq", "dk", "dv"), got, (want, qr.grad, kr.grad, vr.grad),
                                (rtol_o, rtol_g, rtol_g, rtol_g)):
        _assert_close(name, g, w, rtol, f"({dtype} on {device}, ring {ring_size})")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [PACKED, (40,)])
@pytest.mark.parametrize("ring_size, hq, hkv", [(1, 4, 4), (2, 8, 2), (4, 3, 1)])
def test_fused_tiles_match_dense_attention(dtype: torch.dtype, lens: tuple[int, ...], ring_size: int, hq: int,
                                           hkv: int) -> None:
    _check_fused_tiles("cpu", dtype, lens, ring_size, hq, hkv)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("ring_size, hq, hkv", [(1, 4, 4), (2, 8, 2)])
def test_bounded_tiles_match_dense_attention(dtype: torch.dtype, ring_size: int, hq: int, hkv: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Boxes cut into tiles of at most 3 rows and keys (long sequences' grid) stay exact."""
    monkeypatch.setattr(ring_tiles, "MAX_TILE", 3)
    _check_fused_tiles("cpu", dtype, PACKED, ring_size, hq, hkv)


def test_planner_counts_the_runtime_tile_bound() -> None:
    assert RING_TILE_TOKENS == ring_tiles.MAX_TILE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ring_size, hq, hkv", [(1, 4, 4), (2, 8, 2), (4, 3, 1)])
def test_fused_tiles_match_dense_attention_on_cuda(dtype: torch.dtype, ring_size: int, hq: int, hkv: int) -> None:
    """CUDA's memory-efficient kernel (k/v expanded to the q heads); fp32 there may use TF32-free
    fp32 math, so the fp32 tolerance is the same as on CPU."""
    _check_fused_tiles("cuda", dtype, PACKED, ring_size, hq, hkv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_ring_attention_on_cuda_matches_dense(dtype: torch.dtype) -> None:
    """ring_attention (ring size 1) on CUDA: fused for fp32/bf16, the explicit fallback for fp64."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(40, h, D, generator=gen, dtype=torch.float64).to(dtype).double() for h in (4, 2, 2, 4))
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    want = _dense(qr, kr, vr, PACKED)
    want.backward(do)
    qt, kt, vt = (x.to(device="cuda", dtype=dtype).requires_grad_() for x in (q, k, v))
    out = ring_attention(qt, kt, vt, build_ring_plan(None, _cu(PACKED), 40), SCALE)
    out.backward(do.to(device="cuda", dtype=dtype))
    rtol_o, rtol_g = tolerances(dtype)
    for name, got, ref, rtol in zip(("o", "dq", "dk", "dv"), (out, qt.grad, kt.grad, vt.grad),
                                    (want, qr.grad, kr.grad, vr.grad), (rtol_o, rtol_g, rtol_g, rtol_g)):
        _assert_close(name, got, ref, rtol, f"({dtype} on cuda)")


@pytest.mark.parametrize("q_len, k_len", [(5, 9), (9, 5), (1, 7)])
def test_full_tile_with_uneven_lengths_and_grouped_heads(q_len: int, k_len: int) -> None:
    """A full tile with Q != K, 8 q / 2 kv heads unexpanded: fp32 kernel vs fp64 softmax, and the lse."""
    gen = torch.Generator().manual_seed(q_len)
    q, do = (torch.randn(q_len, 8, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(k_len, 2, D, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    qr = q.clone().requires_grad_()
    scores = torch.einsum("qhd,khd->hqk", qr, k.repeat_interleave(4, 1)) * SCALE
    want = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v.repeat_interleave(4, 1))
    want.backward(do)
    o, lse = fused_forward(q.float(), k.detach().float(), v.detach().float(), False, SCALE)
    rtol_o, rtol_g = tolerances(torch.float32)
    _assert_close("lse", lse, torch.logsumexp(scores, -1).detach(), rtol_o)
    grads = fused_backward(do.float(), q.float(), k.detach().float(), v.detach().float(), o, lse, False, SCALE)
    for name, got, ref, rtol in zip(("o", "dq", "dk", "dv"), (o, *grads), (want, qr.grad, k.grad, v.grad),
                                    (rtol_o, rtol_g, rtol_g, rtol_g)):
        assert got.shape == ref.shape
        _assert_close(name, got, ref.detach(), rtol)


@pytest.mark.parametrize("row_chunk", [1024, 3])
def test_explicit_fallback_still_matches_dense(row_chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The explicit path, taken where no fused kernel serves the dtype, through ring_attention."""
    monkeypatch.setattr(ring_module, "fused_supported", lambda device, dtype: False)
    monkeypatch.setattr(ring_module, "ROW_CHUNK", row_chunk)
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(40, h, D, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    want = _dense(qr, kr, vr, PACKED)
    want.backward(do)
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    out = ring_attention(qt, kt, vt, build_ring_plan(None, _cu(PACKED), 40), SCALE)
    out.backward(do)
    rtol_o, rtol_g = tolerances(torch.float64)
    for name, got, ref, rtol in zip(("o", "dq", "dk", "dv"), (out, qt.grad, kt.grad, vt.grad),
                                    (want, qr.grad, kr.grad, vr.grad), (rtol_o, rtol_g, rtol_g, rtol_g)):
        _assert_close(name, got, ref.detach(), rtol, "(fp64, explicit path)")


def test_fused_kernels_cover_cpu_dtypes() -> None:
    cpu = torch.device("cpu")
    assert all(fused_supported(cpu, dt) for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16))
    assert not fused_supported(torch.device("meta"), torch.float32)
