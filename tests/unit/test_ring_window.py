"""Ring attention on sliding-window and soft-capped layers against the single-rank windowed kernels, every element.

The ring is simulated in one process from the plans of every rank (rlsp/parallel/ring_plan.py, windowed boxes):
each step's boxes run the explicit block math (rlsp/parallel/ring_reference.py `attend_box`, soft-capped), merged
by log-sum-exp, then `attend_box_backward` with the merged output/lse; outputs and dq/dk/dv are scattered back
to stream positions and compared with autograd of rlsp.models.window_attention's `banded_attention` over the
packed stream (the kernel Ulysses runs, verified against transformers' own attention in
tests/unit/test_window_attention.py). ring_attention itself (ring size 1: one block, the plumbing from its
arguments to the block math) is compared the same way; ring 2 and Ulysses 2 x ring 2 of whole models:
tests/distributed/test_ring_window_exact.py.

Attention sinks (gpt-oss): joined once after the merge, their gradient included. Windows: 1 (the diagonal only), 3 (smaller than a zigzag chunk), 7 (spanning chunks of ring 4) and 1000 (longer
than the stream: plain causal); soft-cap 0.5 (tanh saturates: a lost factor 1 - tanh^2 is O(1) off) or none.
Tolerances from tests/tolerances.py: fp64, 4 chained reductions forward and 8 backward of at most 40 terms.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_gemma import gemma_config
from tiny_gpt_oss import gpt_oss_config
from tolerances import roundoff_rtol, scalar_tol
from transformers import Qwen2Config

from rlsp.models.family_checks import check_ring_support
from rlsp.models.window_attention import banded_attention
from rlsp.parallel import ring_reference
from rlsp.parallel.ring import ring_attention
from rlsp.parallel.ring_plan import RingPlan, build_ring_plan, zigzag_indices
from rlsp.parallel.ring_sinks import apply_sinks, sink_grad

D, SCALE, KEYS = 8, 8**-0.5, 40
PACKED = (7, 13, 1, 5, 10, 4)  # 40 tokens: boundaries inside zigzag chunks, a 1-token segment
LAYOUTS = (PACKED, (40,), (16, 24))
WINDOWS = (1, 3, 7, 1000)
RTOL_O = roundoff_rtol(reduction=KEYS, stages=4, dtype=torch.float64)
RTOL_G = roundoff_rtol(reduction=KEYS, stages=8, dtype=torch.float64)


def _cu(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _plan_for(lens: tuple[int, ...], ring_size: int, ring_rank: int) -> RingPlan:
    """A plan for one rank of a ring without a process group (metadata only)."""
    total = sum(lens)
    plan = build_ring_plan(None, _cu(lens), total)
    plan.ring_size, plan.ring_rank = ring_size, ring_rank
    plan.positions_RT = torch.stack([zigzag_indices(total, ring_size, i) for i in range(ring_size)])
    return plan


def _reference(q, k, v, do, lens, window, softcap, sinks=None) -> list[torch.Tensor]:
    """(o, dq, dk, dv[, dsinks]) of the single-rank banded kernel (kv heads expanded to the q heads, summed back)."""
    group = q.shape[1] // k.shape[1]
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    sr = None if sinks is None else sinks.clone().requires_grad_()
    bounds = [(int(a), int(b)) for a, b in zip(_cu(lens)[:-1], _cu(lens)[1:]) if b > a]
    out = banded_attention(qr, kr.repeat_interleave(group, 1), vr.repeat_interleave(group, 1), bounds, SCALE,
                           window, softcap, sinks_H=sr)
    out.backward(do)
    return [out.detach(), qr.grad, kr.grad, vr.grad, *([] if sr is None else [sr.grad])]


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, blk_lse: torch.Tensor) -> None:
    new = torch.logaddexp(lse, blk_lse)
    safe = ring_reference.finite(new)
    out.mul_(torch.exp(lse - safe).T[..., None]).add_(o * torch.exp(blk_lse - safe).T[..., None])
    lse.copy_(new)


def _simulated_ring(q, k, v, do, lens, ring_size, window, softcap, row_chunk, sinks=None) -> list[torch.Tensor]:
    """(o, dq, dk, dv[, dsinks]) at stream positions from the windowed boxes of every rank and step; sinks joined
    once after the merge (rlsp/parallel/ring_sinks.py), their gradient summed over the ranks' rows."""
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out, lse = torch.zeros_like(q), torch.full(q.shape[1::-1], float("-inf"), dtype=q.dtype)
    plans = [_plan_for(lens, ring_size, i) for i in range(ring_size)]
    boxes = [(p.positions_RT[p.ring_rank][b.q0:b.q1], p.positions_RT[p.source_rank(s)][b.k0:b.k1], b) for p in plans
             for s, blocks in enumerate(p.step_blocks(torch.device("cpu"), window)) for b in blocks]
    for rows, keys, box in boxes:
        assert box.window == window and (window is None or box.tiles == ())
        o, blk_lse = ring_reference.attend_box(q[rows], ke[keys], ve[keys], box, SCALE, row_chunk, softcap)
        sub_out, sub_lse = out[rows], lse[:, rows]
        _merge(sub_out, sub_lse, o, blk_lse)
        out[rows], lse[:, rows] = sub_out, sub_lse
    dsinks = []
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
        dsinks = [sum(sink_grad(do[p.positions_RT[p.ring_rank]], out[p.positions_RT[p.ring_rank]],
                                lse[:, p.positions_RT[p.ring_rank]], sinks) for p in plans)]
    delta = (do * out).sum(-1).T
    grads = [torch.zeros_like(x) for x in (q, ke, ve)]
    for rows, keys, box in boxes:
        dq, dk, dv = ring_reference.attend_box_backward(do[rows], q[rows], ke[keys], ve[keys], box, SCALE,
                                                        lse[:, rows], delta[:, rows], row_chunk, softcap)
        grads[0][rows] += dq
        grads[1][keys] += dk
        grads[2][keys] += dv
    return [out, grads[0], *(g.unflatten(1, (k.shape[1], group)).sum(2) for g in grads[1:]), *dsinks]


def _inputs(seed: int, hq: int = 4, hkv: int = 2, total: int = 40) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, D, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _assert_all_close(got: list[torch.Tensor], ref: list[torch.Tensor], where: str) -> None:
    assert len(got) == len(ref)
    for name, g, r, rtol in zip(("o", "dq", "dk", "dv", "dsinks"), got, ref, (RTOL_O, *[RTOL_G] * 4)):
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)} {where}"
        err, tol = (g - r).abs().max().item(), scalar_tol(r.abs().max().item(), rtol)
        assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g} {where}"


@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("lens", LAYOUTS)
@pytest.mark.parametrize("ring_size", [2, 4])
def test_windowed_ring_matches_banded_attention(ring_size, lens, window, softcap) -> None:
    q, k, v, do = _inputs(seed=ring_size + window)
    ref = _reference(q, k, v, do, lens, window, softcap)
    for row_chunk in (1024, 2):  # one chunk per box, and chunks with key bands of their own
        got = _simulated_ring(q, k, v, do, lens, ring_size, window, softcap, row_chunk)
        _assert_all_close(got, ref, f"(ring {ring_size}, lens {lens}, window {window}, softcap {softcap}, "
                                    f"row_chunk {row_chunk})")


@pytest.mark.parametrize("window,softcap", [(None, 0.5), (1, None), (3, 0.5), (1000, None)])
def test_ring_attention_entry_applies_window_and_softcap(window, softcap) -> None:
    """ring_attention at ring size 1 (no process group): the window and cap reach the block math."""
    q, k, v, do = _inputs(seed=11)
    ref = _reference(q, k, v, do, PACKED, window, softcap)
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    out = ring_attention(qt, kt, vt, build_ring_plan(None, _cu(PACKED), 40), SCALE, window=window, softcap=softcap)
    out.backward(do)
    _assert_all_close([out.detach(), qt.grad, kt.grad, vt.grad], ref, f"(window {window}, softcap {softcap})")


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("ring_size", [2, 4])
def test_sinks_join_the_merged_rows_once(ring_size, window) -> None:
    """gpt-oss's sinks: the simulated ring (sinks after the merge) and ring_attention (ring 1; fused kernels on a
    full layer, the explicit path on a windowed one) against the banded kernel with sinks, dsinks included."""
    q, k, v, do = _inputs(seed=3)
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ref = _reference(q, k, v, do, PACKED, window, None, sinks)
    got = _simulated_ring(q, k, v, do, PACKED, ring_size, window, None, 1024, sinks)
    _assert_all_close(got, ref, f"(simulated ring {ring_size}, window {window}, sinks)")
    qt, kt, vt, st = (x.clone().requires_grad_() for x in (q, k, v, sinks))
    out = ring_attention(qt, kt, vt, build_ring_plan(None, _cu(PACKED), 40), SCALE, window=window, sinks_H=st)
    out.backward(do)
    _assert_all_close([out.detach(), qt.grad, kt.grad, vt.grad, st.grad], ref, f"(ring_attention, window {window})")


def test_window_skips_blocks_outside_it() -> None:
    """Zigzag chunks of 5 tokens at ring 4: window 3 reaches only the neighbouring chunk, so a rank computes the
    blocks holding its chunks' neighbours and skips the rest; without a window every rank computes them all."""
    counts = [_plan_for((40,), 4, i).block_counts(3) for i in range(4)]
    plain = [_plan_for((40,), 4, i).block_counts(None) for i in range(4)]
    assert plain == [(4, 0)] * 4
    # rank i holds chunks i and 7-i; chunk c's window reaches chunk c-1: rank 0 (chunks 0, 7) needs itself and
    # rank 1 (chunk 6); ranks 1 and 2 need both neighbours; rank 3 (chunks 3, 4) needs itself and rank 2
    assert counts == [(2, 2), (3, 1), (3, 1), (2, 2)]
    assert all(c + s == 4 for c, s in counts)


def test_window_and_softcap_are_checked() -> None:
    q, k, v, _ = _inputs(seed=1)
    plan = build_ring_plan(None, _cu(PACKED), 40)
    with pytest.raises(ValueError, match="sliding window=0; legal: a positive int"):
        ring_attention(q, k, v, plan, SCALE, window=0)
    with pytest.raises(ValueError, match="softcap=-1.0; legal: a positive number"):
        ring_attention(q, k, v, plan, SCALE, softcap=-1.0)


def test_stats_count_computed_and_skipped_blocks() -> None:
    """A stats object with ring_blocks_computed / ring_blocks_skipped gets the plan's counts per forward call."""
    q, k, v, _ = _inputs(seed=2)
    stats = SimpleNamespace(ring_bytes_fwd=0, ring_calls_fwd=0, ring_blocks_computed=0, ring_blocks_skipped=0)
    plan = build_ring_plan(None, _cu(PACKED), 40)
    for _ in range(2):
        ring_attention(q, k, v, plan, SCALE, stats=stats, window=3)
    assert (stats.ring_blocks_computed, stats.ring_blocks_skipped, stats.ring_calls_fwd) == (2, 0, 2)


def test_check_ring_support_accepts_the_verified_windowed_families() -> None:
    for config in (gemma_config("gemma2"), gemma_config("gemma3_text"), gpt_oss_config()):
        check_ring_support(config, 2)
    unverified = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                             max_window_layers=1)
    with pytest.raises(ValueError, match=r"ring_sequence_parallel_size=2: qwen2 has sliding-window layers .* verified "
                                         r"for \['gemma2', 'gemma3_text', 'gpt_oss'\] only"):
        check_ring_support(unverified, 2)
