"""Ring attention over gloo is exact: each rank's output rows and q/k/v gradient rows equal dense
fp64 attention over the whole packed stream (every element; fp32 abs <= 1e-5, fp64 <= 1e-10).

Every rank of a ring group builds the same random q/k/v/upstream gradient for the whole stream
(seeded by its ring group), takes its zigzag rows and runs ring_attention; the parent compares the
rows with the reference. The stream has segments of unequal lengths (7, 13, 1, 5, 10, padding
tail 4), the 13-token segment spanning several zigzag chunks, plus a single 40-token sequence.
Rings: 2 ranks (whole world), 4 ranks (whole world) and two rings {0, 2} and {1, 3} of a world of
4 with different data each (global vs group ranks). Bytes sent are checked against the formula
in rlsp/parallel/ring.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_distributed  # noqa: E402

from rlsp.parallel.ring import ring_attention  # noqa: E402
from rlsp.parallel.ring_plan import build_ring_plan, zigzag_indices  # noqa: E402
from rlsp.parallel.ulysses import SPStats  # noqa: E402

pytestmark = pytest.mark.distributed

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
HEAD_DIM = 8
SCALE = HEAD_DIM**-0.5
PACKED = (7, 13, 1, 5, 10, 4)  # 40 tokens: a multiple of 2 * ring for ring 2 and 4; 4 = padding tail
CASES = [  # (dtype, hq, hkv, kv_index, segment lengths)
    *((dt, hq, hkv, idx, PACKED) for dt in (torch.float32, torch.float64)
      for hq, hkv, idx in ((4, 2, None), (3, 3, None), (3, 2, [0, 0, 1]))),
    (torch.float64, 4, 2, None, (40,)),
]


def _cu(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _stream(case: tuple, seed: int) -> list[torch.Tensor]:
    """q, k, v and the upstream gradient for the whole stream (fp64 values, cast to the case dtype)."""
    dtype, hq, hkv, _, lens = case
    gen = torch.Generator().manual_seed(seed)
    shapes = [(sum(lens), h, HEAD_DIM) for h in (hq, hkv, hkv, hq)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _ring_worker(rank: int, world_size: int, groups: list[list[int]] | None) -> list[dict[str, Any]]:
    if groups is None:
        group, seed = dist.group.WORLD, 0
    else:
        handles = [dist.new_group(g) for g in groups]  # every rank creates every group, in order
        g = next(i for i, ranks in enumerate(groups) if rank in ranks)
        group, seed = handles[g], 100 * (g + 1)
    results = []
    for n, case in enumerate(CASES):
        _, _, _, kv_index, lens = case
        plan = build_ring_plan(group, _cu(lens), sum(lens))
        rows = zigzag_indices(plan.total_len, plan.ring_size, plan.ring_rank)
        q, k, v, do = (x[rows].clone() for x in _stream(case, seed + n))
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        stats = SPStats()  # the counters rlsp's attention passes to the ring
        index = torch.tensor(kv_index) if kv_index is not None else None
        out = ring_attention(q, k, v, plan, SCALE, index, stats)
        out.backward(do)
        results.append({"seed": seed + n, "ring_size": plan.ring_size, "rows": rows, "o": out.detach(),
                        "dq": q.grad, "dk": k.grad, "dv": v.grad, "stats": stats})
    return results


def _reference(case: tuple, seed: int) -> dict[str, torch.Tensor]:
    """Dense fp64 attention over the whole stream (masked softmax) and its q/k/v gradients."""
    _, hq, hkv, kv_index, lens = case
    q, k, v, do = (x.to(torch.float64, copy=True) for x in _stream(case, seed))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    index = torch.tensor(kv_index) if kv_index is not None else torch.arange(hq) // (hq // hkv)
    total, cu = sum(lens), _cu(lens)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(total)
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    assert int(cu[-1]) == total
    scores = torch.einsum("qhd,khd->hqk", q, k.index_select(1, index)) * SCALE
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.index_select(1, index))
    out.backward(do)
    return {"o": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _check_rank(rank: int, result: dict[str, Any], case: tuple) -> None:
    dtype, hq, hkv, _, lens = case
    ref = _reference(case, result["seed"])
    rows, r = result["rows"], result["ring_size"]
    for name in ("o", "dq", "dk", "dv"):
        got = result[name]
        assert got.dtype == dtype and got.shape == ref[name][rows].shape, f"rank {rank} {name}: {got.shape}"
        err = (got.double() - ref[name][rows]).abs().max().item()
        assert err <= TOL[dtype], f"rank {rank} case {case}: {name} max abs error {err:.3g} > {TOL[dtype]:.0g}"
    block = 2 * (sum(lens) // r) * hkv * HEAD_DIM  # K and V of one rank, hkv heads
    e_in, e_acc = dtype.itemsize, 8 if dtype == torch.float64 else 4
    stats = result["stats"]
    assert (stats.ring_calls_fwd, stats.ring_calls_bwd) == (1, 1)
    assert stats.ring_bytes_fwd == (r - 1) * block * e_in, f"rank {rank}: forward bytes {stats.ring_bytes_fwd}"
    want_bwd = (r - 1) * block * (e_in + e_acc)
    assert stats.ring_bytes_bwd == want_bwd, f"rank {rank}: backward bytes {stats.ring_bytes_bwd} != {want_bwd}"


@pytest.mark.parametrize("world_size, groups, ring_size", [
    (2, None, 2),
    (4, None, 4),
    (4, [[0, 2], [1, 3]], 2),  # two rings of 2 that are not the whole world
])
def test_ring_attention_matches_dense_reference(
    world_size: int, groups: list[list[int]] | None, ring_size: int
) -> None:
    results = run_distributed(_ring_worker, world_size, groups)  # 300 s default: ample when busy
    for rank, per_case in enumerate(results):
        for result, case in zip(per_case, CASES):
            assert result["ring_size"] == ring_size
            _check_rank(rank, result, case)
    if groups is not None:  # each ring computed its own data: seeds differ between the groups
        assert results[0][0]["seed"] == results[2][0]["seed"] != results[1][0]["seed"]
