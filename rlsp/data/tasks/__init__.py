"""Synthetic tasks written as parquet datasets with verl's columns."""

from __future__ import annotations

import os
from typing import Any


def write_splits_parquet(out_dir: str, train_rows: list[dict[str, Any]],
                         test_rows: list[dict[str, Any]]) -> tuple[str, str]:
    """Write `train.parquet` and `test.parquet` under `out_dir` (pyarrow tables of the rows); returns their paths."""
    import pyarrow as pa  # noqa: PLC0415 -- keeps the generators importable without pyarrow
    import pyarrow.parquet as pq  # noqa: PLC0415

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, rows in (("train", train_rows), ("test", test_rows)):
        path = os.path.join(os.path.abspath(out_dir), f"{name}.parquet")
        tmp = f"{path}.tmp-{os.getpid()}"  # write then rename: a concurrent reader never sees a partial file
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]
