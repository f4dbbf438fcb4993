"""The driver's one way to read columns the workers hold: `read_columns(wg, data, names)`.

A StepData (rlsp.controller.step_data) leaves the rows' columns in the processes that computed them;
the driver computes on the columns it holds. Where a driver-side computation needs a worker-held column
(a token-level fallback, a metric, a validation log), the loop names it in one `read_columns` call before
that computation, and a worker builds exactly those columns for it. Indexing a column nobody read raises
`ColumnNotRead`: reading is never a side effect of indexing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from rlsp.controller.step_data import StepData
from rlsp.controller.step_meta import ColumnNotRead
from rlsp.controller.traffic import TRAFFIC
from rlsp.data.batch import Batch
from rlsp.workers.columns import RowsSpec

__all__ = ["ColumnNotRead", "Read", "RowReader", "held", "read_columns"]

# (rows, names) -> the rows, with the worker-held columns among `names` read to the driver: how the driver-side
# computations of the loop are handed the reading (`functools.partial(read_columns, wg)`, or `held`).
Read = Callable[[Any, Iterable[str]], Any]


def held(data: Any, names: Iterable[str]) -> Any:
    """The `Read` of rows the driver holds whole (a Batch): nothing to read."""
    return data


class RowReader(Protocol):
    """What reads rows for the driver: a worker group (rlsp.controller.worker_group.RayWorkerGroup.read_rows),
    which builds the rows `spec` describes from the blocks `refs` in one of its processes and returns them."""

    def read_rows(self, spec: RowsSpec, *refs: Any) -> Batch: ...


def read_columns(wg: RowReader, data: StepData, names: Iterable[str]) -> StepData:
    """Bring the columns `names` of `data` to the driver: those the workers hold in one call on `wg` (its
    rank 0 builds just those columns from the blocks, so only they cross), then the driver-built ones among
    `names` (`derive`, `set_row`; the workers' columns they read come in a further call each). Names the driver
    holds already, or that are not columns of the step, are skipped. Returns `data` (a Batch as it is: the
    driver holds all of it)."""
    if not isinstance(data, StepData):
        return data
    names = list(names)
    _read(wg, data, data.unread(names))
    for name in names:
        if data.builds(name):
            _build(wg, data, name)
    return data


def _build(wg: RowReader, data: StepData, name: str) -> None:
    while True:
        try:
            data[name]
            return
        except ColumnNotRead as missing:  # a column the build reads: read it, then build again
            keys = data.unread([missing.key])
            if not keys:
                raise
            _read(wg, data, keys)


def _read(wg: RowReader, data: StepData, keys: list[str]) -> None:
    if not keys:
        return
    spec, refs = data.spec(range(len(data)), keys)
    spec.by_value = None
    rows = wg.read_rows(spec, *refs)
    TRAFFIC.wait()
    TRAFFIC.send(spec)
    TRAFFIC.receive(rows)
    data.store(rows)

