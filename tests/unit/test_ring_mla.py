"""Ring attention with a v head dim other than q/k's (multi-latent attention: DeepSeek-V2/V3) against dense attention.

ring_attention at ring size 1 (one block: the plumbing from its arguments to the block math, the K/V buffer with k and
v side by side, rlsp/parallel/ring_grads.py) over a packed stream of unequal segments, Dv < Dk and Dv > Dk, fp32 and
fp64, 4 q / 2 kv heads: the fused CPU kernel (v, or q and k, zero-padded per tile: rlsp/parallel/ring_block.py) and
the explicit path (a window longer than the stream routes there); output and dq/dk/dv every element against dense
fp64 attention, bounds from tests/tolerances.py. Rings of 4 ranks with Dv != Dk:
tests/distributed/test_ring_window_exact.py.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import roundoff_rtol

from rlsp.parallel.ring import ring_attention
from rlsp.parallel.ring_plan import build_ring_plan

LENS = (7, 13, 1, 5, 10, 4)
HQ, HKV = 4, 2


def _cu() -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)


def _dense(q, k, v, do, scale):
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    seg = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))
    pos = torch.arange(sum(LENS))
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    index = torch.arange(HQ) // (HQ // HKV)
    scores = torch.einsum("qhd,khd->hqk", q, k[:, index]) * scale
    o = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1), v[:, index])
    o.backward(do.double())
    return o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dk,dv", [(10, 6), (6, 10)])
@pytest.mark.parametrize("window", [None, 1000])  # None: fused kernel; 1000 (> stream): explicit path
def test_ring_attention_with_own_v_head_dim_matches_dense(dtype, dk, dv, window):
    total, gen = sum(LENS), torch.Generator().manual_seed(dk * 100 + dv)
    q, k, v, do = (torch.randn(total, h, d, generator=gen, dtype=dtype)
                   for h, d in ((HQ, dk), (HKV, dk), (HKV, dv), (HQ, dv)))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    scale = dk**-0.5
    out = ring_attention(q, k, v, build_ring_plan(None, _cu(), total), scale, window=window)
    out.backward(do)
    assert out.shape == (total, HQ, dv) and out.dtype == dtype
    rtol = roundoff_rtol(reduction=max(LENS), stages=8, dtype=dtype)
    for name, got, want in zip(("o", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), _dense(q, k, v, do, scale)):
        assert got.shape == want.shape, name
        err = (got.double() - want).abs().max().item()
        assert err <= rtol * max(want.abs().max().item(), 1.0), f"{name} ({dtype}, dk={dk}, dv={dv}): {err:.3g}"


def test_k_head_dim_must_be_qs():
    plan = build_ring_plan(None, _cu(), sum(LENS))
    q, v = torch.randn(sum(LENS), HQ, 8), torch.randn(sum(LENS), HKV, 6)
    with pytest.raises(ValueError, match=r"k has shape \(40, 2, 6\); expected \[Tr=40, hkv, D=8\]"):
        ring_attention(q, torch.randn(sum(LENS), HKV, 6), v, plan, 1.0)
