"""Packed causal attention (sp=1 context) equals exact attention per sequence, on both inner paths:
one batched SDPA over segments padded to the longest, and one SDPA call per segment."""

from __future__ import annotations

import pytest
import torch

from rlsp.data.packing import pack_sequences
from rlsp.models.attention import _padded_plan, ulysses_attention
from rlsp.parallel.ulysses import build_sp_context


class _Layer(torch.nn.Module):
    layer_idx = 0


def _reference(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, lens: list[int]) -> torch.Tensor:
    group = q_THD.shape[1] // k_THD.shape[1]
    out, start = [], 0
    for n in lens:
        q, k, v = (x[start:start + n].transpose(0, 1) for x in (q_THD, k_THD, v_THD))
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = (q @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append((torch.softmax(scores, -1) @ v).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("lens, padded", [
    ((7, 13, 5, 10, 12), True),  # similar lengths: one batched call
    ((40, 2, 3, 1, 2, 5, 1, 3), False),  # one long sequence among short ones: per segment (padding > 4x)
    ((9,), False),  # one segment
])
@pytest.mark.parametrize("heads", [(4, 2), (6, 6)])
def test_both_inner_paths_match_exact_attention(lens: tuple[int, ...], padded: bool, heads: tuple[int, int]) -> None:
    hq, hkv = heads
    width = max(lens)
    ids = torch.ones(len(lens), width, dtype=torch.long)
    mask = (torch.arange(width)[None, :] < torch.tensor(lens)[:, None]).long()
    ctx = build_sp_context(None, pack_sequences(ids, mask), hq, hkv)
    assert (_padded_plan(ctx, torch.device("cpu")) is not None) == padded
    gen = torch.Generator().manual_seed(0)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv))
    out, _ = ulysses_attention(_Layer(), *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), None, sp_context=ctx)
    ref = _reference(q, k, v, list(lens))
    torch.testing.assert_close(out[0], ref, atol=1e-12, rtol=0)
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out[0] * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
