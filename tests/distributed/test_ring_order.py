"""Ring attention's point-to-point ops match pairwise in order and shape, as NCCL needs (it ignores tags).

Each rank records every op it posts through `dist.batch_isend_irecv` during one forward and backward
(the wrapper lives in this test's worker processes only): (group, peer, send/recv, shape, dtype), per
batch. For every group and every ordered pair of ranks (i -> j), i's sends to j must equal j's receives
from i, in order, shape and dtype; every rank of a group must post the same number of batches on it,
each with ops (so the first batched call on a group involves all of its ranks, as NCCL requires). Run
on gloo at ring 2 and 4, over the meshes rlsp builds (dK/dV on `ring_dkv_group`: a group of their own)
and over one shared group (`dkv_group=None`), with a stream whose steps include ones without a visible
box, and with a ring x Ulysses layout whose rings are not the whole world.
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
from rlsp.parallel.ring_plan import build_ring_plan, zigzag_indices  # noqa: E402

pytestmark = pytest.mark.distributed

LENS = (7, 13, 1, 5, 10, 4)  # 40 tokens, segments across zigzag chunks
# the other stream: one segment per zigzag chunk, so a rank's queries and a visiting block share no
# segment at every step but the first (no visible box)
HQ, HKV, D = 4, 2, 8


def _record(log: list[dict[str, Any]]):
    """A batch_isend_irecv that appends each batch's ops to `log` before posting them."""
    post = dist.batch_isend_irecv

    def recording(ops: list[dist.P2POp]) -> list[dist.Work]:
        log.append({"group": ops[0].group.group_name, "ranks": dist.get_process_group_ranks(ops[0].group),
                    "ops": [(op.group.group_name, op.peer, "send" if op.op is dist.isend else "recv",
                             tuple(op.tensor.shape), str(op.tensor.dtype)) for op in ops]})
        return post(ops)

    return recording


def _order_worker(rank: int, world_size: int, ulysses: int, ring: int, shared: bool) -> dict[str, Any]:
    dims = layout_dims(ulysses=ulysses, ring=ring)
    dkv_group = None if shared else dims.ring_dkv_group
    log: list[dict[str, Any]] = []
    empty_steps = 0
    for lens in (LENS, (sum(LENS) // (2 * ring),) * 2 * ring):
        total = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        plan = build_ring_plan(dims.ring_group, cu, total, dkv_group=dkv_group)
        rows = zigzag_indices(total, plan.ring_size, plan.ring_rank)
        gen = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(total, h, D, generator=gen)[rows].clone() for h in (HQ, HKV, HKV, HQ))
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        post, dist.batch_isend_irecv = dist.batch_isend_irecv, _record(log)
        try:
            ring_attention(q, k, v, plan, D**-0.5).backward(do)
        finally:
            dist.batch_isend_irecv = post
        empty_steps += sum(not blocks for blocks in plan.step_blocks(q.device))
    groups = {"kv": plan.group.group_name, "dkv": plan.grad_group.group_name}
    try:  # a dK/dV group over other ranks than the ring's is refused
        build_ring_plan(dims.ring_group, cu, total, dkv_group=dist.group.WORLD)
        refused = ring == world_size  # the whole world is this ring's ranks: accepted
    except ValueError as exc:
        refused = "must be a second group over the same ranks" in str(exc)
    return {"batches": log, "groups": groups, "empty_steps": empty_steps, "refused": refused}


def _check_pairs(results: list[dict[str, Any]]) -> int:
    """Every (group, i -> j): i's sends == j's receives in order, shape and dtype. Returns the pairs seen."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, result in enumerate(results):
        for batch in result["batches"]:
            for group, peer, direction, shape, dtype in batch["ops"]:
                if direction == "send":
                    sends[group, rank, peer].append((shape, dtype))
                else:
                    recvs[group, peer, rank].append((shape, dtype))
    assert sends.keys() == recvs.keys()
    for key, sent in sends.items():
        assert sent == recvs[key], f"group {key[0]}, {key[1]} -> {key[2]}: sends {sent} != receives {recvs[key]}"
    return len(sends)


def _check_batches_collective(results: list[dict[str, Any]]) -> None:
    """Each rank of a group posts the same number of batches on it, every one with ops."""
    per_group: dict[str, dict[int, int]] = defaultdict(dict)
    members: dict[str, list[int]] = {}
    for rank, result in enumerate(results):
        for batch in result["batches"]:
            assert batch["ops"] and all(op[0] == batch["group"] for op in batch["ops"])
            per_group[batch["group"]][rank] = per_group[batch["group"]].get(rank, 0) + 1
            members[batch["group"]] = batch["ranks"]
    for group, counts in per_group.items():
        assert sorted(counts) == members[group], (group, counts, members[group])
        assert len(set(counts.values())) == 1, (group, counts)


@pytest.mark.parametrize("world_size, ulysses, ring", [(2, 1, 2), (4, 1, 4), (4, 2, 2)])
@pytest.mark.parametrize("shared", [False, True], ids=["own_dkv_group", "shared_group"])
def test_ring_sends_match_receives_per_pair(world_size: int, ulysses: int, ring: int, shared: bool) -> None:
    results = run_distributed(_order_worker, world_size, ulysses, ring, shared)  # 300 s default: ample when busy
    pairs = _check_pairs(results)
    _check_batches_collective(results)
    for result in results:
        kv, dkv = result["groups"]["kv"], result["groups"]["dkv"]
        assert (kv == dkv) == shared
        by_group = defaultdict(int)
        for batch in result["batches"]:
            by_group[batch["group"]] += 1
        # per stream, forward and backward: r-1 K/V batches each; backward: r-1 dK/dV batches
        assert (by_group[kv], by_group[dkv]) == ((6 * (ring - 1),) * 2 if shared else (4 * (ring - 1), 2 * (ring - 1)))
    assert pairs == world_size * (1 if shared else 2)  # each rank sends to one peer (i+1) per group
    assert all(r["refused"] for r in results)
    assert any(r["empty_steps"] for r in results)  # steps without a visible box still pass their blocks on
