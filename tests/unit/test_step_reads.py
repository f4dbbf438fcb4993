"""Reading worker-held columns on the driver is an explicit call: indexing a column nobody read raises
ColumnNotRead naming it; `read_columns` brings exactly the named columns in one call on the worker group
(driver-built ones after the columns they read), every element equal to the rows cut from the whole batch.

The worker group here builds the rows in this process from blocks that are the Batches themselves (in a
run its rank 0 does, from object references), with `assemble`, as a worker does.
"""

from __future__ import annotations

import pytest
import torch
from test_step_data import _step, _whole

from rlsp.controller.reads import ColumnNotRead, read_columns
from rlsp.data.batch import Batch
from rlsp.workers.columns import assemble


class LocalGroup:
    """A worker group's `read_rows`, in this process; records the columns of every call."""

    def __init__(self) -> None:
        self.calls: list[set[str]] = []

    def read_rows(self, spec, *blocks) -> Batch:
        self.calls.append(set(spec.keys()))
        return assemble(spec, blocks)


ORDER = [9, 2, 5, 0, 7, 1, 8, 3]


def test_indexing_an_unread_column_raises_naming_it() -> None:
    data = _step(_whole())
    with pytest.raises(ColumnNotRead, match="'old_logprobs' is held by the workers.*read_columns"):
        data["old_logprobs"]
    with pytest.raises(ColumnNotRead, match="'ground_truth'"):
        data.meta.get("ground_truth")  # not a silent None: Mapping.get passes only KeyError
    assert data.meta["uid"] == _whole().meta["uid"]  # the driver's own columns read as before
    with pytest.raises(KeyError, match="not a column"):
        data["nowhere"]


def test_read_columns_brings_the_named_columns_in_one_call() -> None:
    whole, group = _whole(), LocalGroup()
    data = _step(whole).select_rows(ORDER)
    assert read_columns(group, data, ["old_logprobs", "ground_truth", "uid", "absent"]) is data
    assert group.calls == [{"old_logprobs", "ground_truth"}]  # uid is the driver's; absent: not a column
    want = whole.select_rows(ORDER)
    assert torch.equal(data["old_logprobs"], want["old_logprobs"])
    assert data.meta["ground_truth"] == want.meta["ground_truth"]
    read_columns(group, data, ["old_logprobs"])
    assert len(group.calls) == 1  # held now: no second call
    with pytest.raises(ColumnNotRead):
        data["input_ids"]  # only what was named came


def test_an_alias_is_read_under_its_source() -> None:
    whole, group = _whole(), LocalGroup()
    data = _step(whole)
    data.alias("rollout_logprobs", "old_logprobs")
    read_columns(group, data, ["rollout_logprobs"])
    assert group.calls == [{"old_logprobs"}]
    assert torch.equal(data["rollout_logprobs"], whole["old_logprobs"])


def test_driver_built_columns_read_what_they_are_built_from() -> None:
    whole, group = _whole(), LocalGroup()
    data = _step(whole).select_rows(ORDER)
    data.derive("doubled_mask", lambda d: d["response_mask"] * 2)
    data.set_row("advantages", torch.arange(len(ORDER), dtype=torch.float32))
    with pytest.raises(ColumnNotRead, match="'response_mask'"):
        data["doubled_mask"]
    assert "doubled_mask" in data  # a failed build is kept for later
    read_columns(group, data, ["doubled_mask", "advantages"])
    assert group.calls == [{"response_mask"}]  # one call: the advantages' expansion finds the mask read
    mask = whole.select_rows(ORDER)["response_mask"]
    assert torch.equal(data["doubled_mask"], mask * 2)
    assert torch.equal(data["advantages"], torch.arange(len(ORDER), dtype=torch.float32)[:, None] * mask)


def test_rows_the_driver_holds_pass_through() -> None:
    whole, group = _whole(), LocalGroup()
    assert read_columns(group, whole, ["input_ids"]) is whole and group.calls == []


def test_a_selection_keeps_a_driver_built_column_for_its_rows() -> None:
    """Builds are row-wise (StepData.derive): selecting rows reads nothing, and the selection's build equals
    the selected rows of the whole build."""
    whole, group = _whole(), LocalGroup()
    data = _step(whole)
    by_id = dict(zip(data.ids, range(len(data))))
    data.derive("scaled_mask", lambda d: d["response_mask"] * torch.tensor([float(by_id[i]) for i in d.ids])[:, None])
    part = data.select_rows(ORDER)
    assert group.calls == []
    read_columns(group, part, ["scaled_mask"])
    read_columns(group, data, ["scaled_mask"])
    assert torch.equal(part["scaled_mask"], data["scaled_mask"][ORDER])
