"""Dispatch contracts and declared fields, stated once on the role method that needs them and read by
the controller.

    BY_DP    the batch is split into `dp` equal parts of the role's mesh (or contiguous parts of the
             row counts a call gives, `shards`: rlsp.controller.worker_group); every sp rank of dp
             group g gets part g (sp ranks must see the same rows) and the call is collective over the
             role's world; the result of each group's sp-rank 0 is collected. Generation too: the rollout's dp
             groups are its engines (one rank each, or the ranks of a tensor-parallel engine).
    ALL      every rank gets the same arguments (collective calls such as weight sync); the results
             of all ranks are returned as a list.

A BY_DP method also declares its fields: `reads`, the columns of the batch it may read (only those are
sent: a read of any other is an error), `writes`, the columns of the Batch it returns (which stays in
the worker's process: the driver gets a handle), and `reports`, per-row values the driver receives
instead of the rows (derived scalars such as each row's token count, see rlsp.workers.columns, or
small per-row entries such as uid). A method returning metrics (a dict) declares no writes. Generation
returns new rows (`new_rows=True`); every other method returns columns of the rows it received.

The controller refuses to call a method that has no declaration, so a new role method cannot be
dispatched by accident with the wrong contract.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "__rlsp_dispatch__"
_FIELDS = "__rlsp_fields__"


class Dispatch(enum.Enum):
    BY_DP = "by_dp"
    ALL = "all"


@dataclass(frozen=True)
class Fields:
    """What a BY_DP method reads from its rows, writes into the Batch it returns, and reports to the driver."""

    reads: frozenset[str]
    writes: frozenset[str]
    reports: tuple[str, ...]
    new_rows: bool  # the returned rows are new ones (generation), not columns of the rows received


def register(mode: Dispatch, *, reads: Iterable[str] = (), writes: Iterable[str] = (),
             reports: Iterable[str] = (), new_rows: bool = False) -> Callable[[F], F]:
    """Declare how the controller dispatches calls of the decorated method (and, BY_DP, its fields)."""
    if mode is Dispatch.ALL and (reads or writes or reports):
        raise ValueError("only BY_DP methods take rows: an ALL method declares no fields")

    def decorator(fn: F) -> F:
        setattr(fn, _ATTR, mode)
        setattr(fn, _FIELDS, Fields(frozenset(reads), frozenset(writes), tuple(reports), new_rows))
        return fn

    return decorator


def dispatch_mode(cls: type, method: str) -> Dispatch:
    """The declared contract of `cls.method`; ValueError naming the declared methods otherwise."""
    fn = getattr(cls, method, None)
    mode = getattr(fn, _ATTR, None)
    if mode is None:
        declared = sorted(name for name in dir(cls) if getattr(getattr(cls, name, None), _ATTR, None) is not None)
        raise ValueError(f"{cls.__name__}.{method} has no dispatch declaration; dispatchable methods: {declared}")
    return mode


def declared_fields(cls: type, method: str) -> Fields:
    """The fields `cls.method` declared (see the module docstring)."""
    dispatch_mode(cls, method)
    return getattr(getattr(cls, method), _FIELDS)
