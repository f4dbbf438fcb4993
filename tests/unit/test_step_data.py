"""The data plane's row routing: a process's rows built from blocks held elsewhere equal the rows cut
from one whole batch, for any row order and selection, every element compared.

Blocks here are the Batches themselves (in a run they are object references that Ray resolves to
them in the receiving process); `StepData.spec` decides which block rows and columns go where,
`assemble` builds them, as a worker does.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlsp.controller.step_data import Block, StepData, new_row_ids
from rlsp.data.batch import Batch
from rlsp.workers.columns import assemble, row_report
from rlsp.workers.dispatch import Dispatch, declared_fields, register
from rlsp.workers.roles import ROLE_CLASSES


def _whole(n: int = 10, R: int = 4) -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch.from_dict({"input_ids": torch.randint(0, 50, (n, 6), generator=g),
                            "response_mask": (torch.rand(n, R, generator=g) > 0.3).float(),
                            "old_logprobs": torch.randn(n, R, generator=g)},
                           meta={"uid": [f"u{i // 2}" for i in range(n)], "ground_truth": [str(i) for i in range(n)]})


def _step(whole: Batch) -> StepData:
    """Rows made by two processes (6 + 4 rows), old logprobs by two others (5 + 5), uid on the driver."""
    ids = new_row_ids(len(whole))
    table = Batch(TensorDict({}, batch_size=[len(whole)]), {"uid": whole.meta["uid"]}, {"temperature": 1.0})
    data = StepData(ids, table)
    gen = [whole.select_rows(slice(0, 6)), whole.select_rows(slice(6, 10))]
    for part, rows in zip(gen, (range(0, 6), range(6, 10))):
        kept = Batch.from_dict({k: part[k] for k in ("input_ids", "response_mask")}, meta={"ground_truth": part.meta["ground_truth"]})
        data.blocks.append(Block(kept, frozenset({"input_ids", "response_mask", "ground_truth"}), tuple(ids[i] for i in rows)))
    for rows in (range(0, 5), range(5, 10)):
        lp = Batch.from_dict({"old_logprobs": whole["old_logprobs"][list(rows)]})
        data.blocks.append(Block(lp, frozenset({"old_logprobs"}), tuple(ids[i] for i in rows)))
    data._tensor_keys |= {"input_ids", "response_mask", "old_logprobs"}
    return data


@pytest.mark.parametrize("order", [list(range(10)), [9, 2, 5, 0, 7, 1, 8, 3, 6, 4], [4, 4, 1, 8]])
def test_rows_from_blocks_equal_the_whole_batch(order: list[int]) -> None:
    whole = _whole()
    data = _step(whole).select_rows(order)
    reads = ("input_ids", "response_mask", "old_logprobs", "uid", "ground_truth", "advantages")
    data.set_row("advantages", torch.arange(len(order), dtype=torch.float32))
    for positions in (range(0, len(order) // 2), range(len(order) // 2, len(order))):
        spec, refs = data.spec(positions, reads)
        rows = assemble(spec, refs)
        want = whole.select_rows([order[p] for p in positions])
        assert rows.keys() == {"input_ids", "response_mask", "old_logprobs", "uid", "ground_truth", "advantages"}
        for key in ("input_ids", "response_mask", "old_logprobs"):
            assert torch.equal(rows[key], want[key]), key
        assert rows.meta["uid"] == want.meta["uid"] and rows.meta["ground_truth"] == want.meta["ground_truth"]
        expected_adv = torch.tensor(list(positions), dtype=torch.float32)[:, None] * want["response_mask"]
        assert torch.equal(rows["advantages"], expected_adv)
        assert rows.info == {"temperature": 1.0}


def test_an_alias_is_read_from_the_blocks_under_its_name() -> None:
    whole = _whole()
    data = _step(whole)
    data.alias("rollout_logprobs", "old_logprobs")
    spec, refs = data.spec(range(3, 8), ("rollout_logprobs", "response_mask"))
    rows = assemble(spec, refs)
    assert rows.keys() == {"rollout_logprobs", "response_mask"}
    assert torch.equal(rows["rollout_logprobs"], whole["old_logprobs"][3:8])
    assert data.source_of("rollout_logprobs") == "old_logprobs" and "rollout_logprobs" in data


def test_only_declared_columns_are_sent() -> None:
    data = _step(_whole())
    spec, refs = data.spec(range(10), ("response_mask",))
    assert spec.keys() == {"response_mask"} and len(refs) == 2  # the two generation blocks, not the logprobs
    assert assemble(spec, refs).keys() == {"response_mask"}


def test_row_report_derives_per_row_counts() -> None:
    whole = _whole()
    report = row_report(whole, ("response_tokens", "uid", "not_there"))
    assert torch.equal(report["response_tokens"], whole["response_mask"].sum(-1))
    assert report.meta == {"uid": whole.meta["uid"]} and report.keys() == {"response_tokens", "uid"}


def test_every_row_method_declares_its_reads() -> None:
    for role, cls in ROLE_CLASSES.items():
        for name in dir(cls):
            fn = getattr(cls, name)
            if getattr(fn, "__rlsp_dispatch__", None) is Dispatch.BY_DP:
                assert declared_fields(cls, name).reads, f"{role}.{name} declares no reads"


def test_all_methods_take_no_fields() -> None:
    with pytest.raises(ValueError, match="declares no fields"):
        register(Dispatch.ALL, reads=("x",))
