"""Adaptive sequence parallelism's plan as the ranks run it: every rank of a world derives its own
micro-batches (`plan_micro_batches`), and together they must form one plan: the same number of
rounds everywhere, the d ranks of a degree-d lane holding the same rows at the same degree, exactly
one of them reporting (idle micro-batches: none), and each row of a dp shard reported exactly once."""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed

from rlsp.data.batch import Batch
from rlsp.engine.micro import plan_micro_batches

pytestmark = pytest.mark.distributed


def _batch(seed: int) -> Batch:
    """24 rows: mostly short, a few at 2x and 4x the budget of 16 tokens per rank."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 16, (18,), generator=g).tolist() + [30, 31, 25, 60, 64, 50]
    mask = torch.zeros(len(lens), 64, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, :n] = 1
    return Batch.from_dict({"input_ids": mask.clone(), "attention_mask": mask})


def _plans(rank: int, world: int, ulysses: int, batch: Batch, quad: float | None):
    dims = layout_dims(ulysses=ulysses, adaptive=True)
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    plans = plan_micro_batches(shard, 1, 16, dims, quad)
    return dims.dp_rank, dims.coords.ulysses, [(p.rows, p.degree, p.reports) for p in plans]


@pytest.mark.parametrize("world,ulysses,quad", [(4, 4, None), (4, 4, 40.0), (4, 2, 40.0)])
def test_every_rank_plan_fits_one_plan(world, ulysses, quad):
    batch = _batch(world + ulysses)
    results = run_distributed(_plans, world, ulysses, batch, quad)
    assert len({len(plans) for _, _, plans in results}) == 1  # FSDP: same number of micro-batches
    assert results == run_distributed(_plans, world, ulysses, batch, quad)  # deterministic
    used: set[int] = set()
    for dp in {r[0] for r in results}:
        ranks = {u: plans for d, u, plans in results if d == dp}
        reported: list[int] = []
        for k in range(len(ranks[0])):
            for u, plans in ranks.items():
                rows, degree, reports = plans[k]
                first = u - u % degree  # the lane: degree consecutive Ulysses ranks
                assert all(ranks[v][k][:2] == (rows, degree) for v in range(first, first + degree))
                if rows:  # an idle micro-batch (no rows) reports nothing either way
                    assert reports == (u == first)
                if reports:
                    reported += rows
        shard = batch.chunk(len({r[0] for r in results}))[dp]
        assert sorted(reported) == list(range(len(shard)))  # every row of the shard exactly once
        lengths = shard["attention_mask"].sum(-1).tolist()
        degrees = {i: plans[k][1] for plans in ranks.values() for k in range(len(plans)) for i in plans[k][0]}
        used |= set(degrees.values())
        divisors = [d for d in (1, 2, 4) if ulysses % d == 0]
        for i, d in degrees.items():  # the smallest degree whose bin holds the row, else the full one
            assert d == next((e for e in divisors if lengths[i] <= 16 * e), ulysses), (lengths[i], d)
    assert sorted(used) == [d for d in (1, 2, 4) if d <= ulysses]  # every degree ran somewhere
