"""The per-row entries (`meta`) of a StepData: the driver's own, and those read from the workers
(rlsp.controller.step_data.read_columns)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlsp.controller.step_data import StepData


class ColumnNotRead(RuntimeError):
    """A driver computation indexed a column the workers hold that nobody read to the driver."""

    def __init__(self, key: str) -> None:
        super().__init__(f"column {key!r} is held by the workers, not the driver: read it first with "
                         f"rlsp.controller.step_data.read_columns(wg, data, [{key!r}])")
        self.key = key


class LazyMeta(Mapping):
    """`StepData.meta`: the driver's per-row entries; one the workers hold raises ColumnNotRead until it is read."""

    def __init__(self, data: StepData) -> None:
        self.data = data

    def __getitem__(self, key: str) -> list[Any]:
        if key not in self.data.table.meta:
            if key not in self.data.block_keys():
                raise KeyError(key)
            raise ColumnNotRead(key)
        return self.data.table.meta[key]

    def __setitem__(self, key: str, values: list[Any]) -> None:
        if len(values) != len(self.data):
            raise ValueError(f"meta[{key!r}] has {len(values)} rows, the step has {len(self.data)}")
        self.data.table.meta[key] = list(values)

    def __contains__(self, key: object) -> bool:
        return key in self.data.table.meta or (key in self.data.block_keys() and not self.data.is_tensor(key))

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(self.data.table.meta) | {k for k in self.data.block_keys() if not self.data.is_tensor(k)}))

    def __len__(self) -> int:
        return len(list(iter(self)))

    def update(self, other: Mapping[str, list[Any]]) -> None:
        for key, values in other.items():
            self[key] = values
