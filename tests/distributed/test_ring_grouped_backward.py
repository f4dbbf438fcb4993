"""Ring attention over gloo with its backward forced into several head groups (rlsp/parallel/ring_heads.py)
is exact: each rank's output and q/k/v gradient rows equal dense fp64 attention over the whole packed
stream, every element (fp32 abs <= 1e-5, fp64 <= 1e-10). Rings of 2 and 4 ranks, 8 q / 2 kv heads in
groups of 1 kv head, 4 q / 4 kv in groups of 1, 3 q / 1 kv (one group). Each rank records its
point-to-point batches: per ordered pair of ranks the sends equal the receives in order, shape and
dtype (as NCCL needs), the backward posts G times the batches of one pass, each [2, Tr, hkv/G, D],
and the bytes sent are the ungrouped formula's, (r-1) * 2*Tr*hkv*D * (e_in + e_acc).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import layout_dims, run_distributed  # noqa: E402

from rlsp.parallel.ring import ring_attention  # noqa: E402
from rlsp.parallel.ring_heads import acc_bytes  # noqa: E402
from rlsp.parallel.ring_plan import build_ring_plan, zigzag_indices  # noqa: E402
from rlsp.parallel.ulysses import SPStats  # noqa: E402

pytestmark = pytest.mark.distributed

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
D = 8
LENS = (7, 13, 1, 5, 10, 4)  # 40 tokens: segments across zigzag chunks, 4 = padding tail
CASES = [(torch.float32, 8, 2, 1), (torch.float64, 8, 2, 1), (torch.float64, 4, 4, 1), (torch.float32, 3, 1, 1)]


def _stream(hq: int, hkv: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(LENS), h, D, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _record(log: list[tuple[int, str, tuple[int, ...], str]]):
    post = dist.batch_isend_irecv

    def recording(ops: list[dist.P2POp]) -> list[dist.Work]:
        log.extend((op.peer, "send" if op.op is dist.isend else "recv", tuple(op.tensor.shape), str(op.tensor.dtype))
                   for op in ops)
        return post(ops)

    return recording


def _worker(rank: int, world_size: int) -> list[dict[str, Any]]:
    dims = layout_dims(ring=world_size)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    results = []
    for n, (dtype, hq, hkv, per_pass) in enumerate(CASES):
        plan = build_ring_plan(dims.ring_group, cu, sum(LENS), dkv_group=dims.ring_dkv_group)
        rows = zigzag_indices(plan.total_len, plan.ring_size, plan.ring_rank)
        q, k, v, do = (x[rows].to(dtype) for x in _stream(hq, hkv, n))
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        stats = SPStats()  # the counters rlsp's attention passes to the ring
        acc = 8 if dtype == torch.float64 else 4
        bound = acc_bytes(plan.local_len, per_pass * hq // hkv, per_pass, D, acc)  # per_pass kv heads fit
        out = ring_attention(q, k, v, plan, D**-0.5, stats=stats, acc_bytes_bound=bound)
        log: list[tuple[int, str, tuple[int, ...], str]] = []
        post, dist.batch_isend_irecv = dist.batch_isend_irecv, _record(log)
        try:
            out.backward(do)
        finally:
            dist.batch_isend_irecv = post
        results.append({"rows": rows, "o": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "log": log,
                        "bytes_bwd": stats.ring_bytes_bwd, "calls_bwd": stats.ring_calls_bwd})
    return results


def _reference(hq: int, hkv: int, seed: int) -> dict[str, torch.Tensor]:
    q, k, v, do = _stream(hq, hkv, seed)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    index = torch.arange(hq) // (hq // hkv)
    seg = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))
    pos = torch.arange(sum(LENS))
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k.index_select(1, index)) * D**-0.5
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1),
                       v.index_select(1, index))
    out.backward(do)
    return {"o": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _check_pairs(logs: list[list[tuple[int, str, tuple[int, ...], str]]]) -> None:
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, log in enumerate(logs):
        for peer, direction, shape, dtype in log:
            (sends[rank, peer] if direction == "send" else recvs[peer, rank]).append((shape, dtype))
    assert sends.keys() == recvs.keys() and all(sends[key] == recvs[key] for key in sends)


@pytest.mark.parametrize("world_size", [2, 4])
def test_grouped_ring_backward_matches_dense_reference(world_size: int) -> None:
    results = run_distributed(_worker, world_size)  # 300 s default: ample when busy
    r = world_size
    for n, (dtype, hq, hkv, per_pass) in enumerate(CASES):
        ref, groups, tr = _reference(hq, hkv, n), hkv // per_pass, sum(LENS) // r
        for rank in range(r):
            got = results[rank][n]
            for name in ("o", "dq", "dk", "dv"):
                err = (got[name].double() - ref[name][got["rows"]]).abs().max().item()
                assert got[name].dtype == dtype and err <= TOL[dtype], f"rank {rank} {name} {hq}q/{hkv}kv: {err:.3g}"
            e_in, e_acc = dtype.itemsize, 8 if dtype == torch.float64 else 4
            assert got["bytes_bwd"] == (r - 1) * 2 * tr * hkv * D * (e_in + e_acc) and got["calls_bwd"] == 1
            sends = [op for op in got["log"] if op[1] == "send"]
            # per group: r-1 K/V sends and r-1 dK/dV accumulator sends, each of the group's kv heads
            want = sorted([((2, tr, per_pass, D), str(dtype))] * groups * (r - 1)
                          + [((2, tr, per_pass, D), str({4: torch.float32, 8: torch.float64}[e_acc]))]
                          * groups * (r - 1))
            assert sorted(op[2:] for op in sends) == want, f"rank {rank} {hq}q/{hkv}kv: sends {sends}"
        _check_pairs([results[rank][n]["log"] for rank in range(r)])
