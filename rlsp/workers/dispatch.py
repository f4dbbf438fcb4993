"""Dispatch contracts, declared once on the role method that needs them and read by the controller.

    BY_DP    the batch is split into `dp` equal parts of the role's mesh; every sp rank of dp group g
             gets part g (sp ranks must see the same rows) and the call is collective over the role's
             world; the result of each group's sp-rank 0 is collected (Batches are concatenated).
             Generation too: the rollout's dp groups are its engines (one rank each, or the ranks of
             a tensor-parallel engine).
    ALL      every rank gets the same arguments (collective calls such as weight sync); the results
             of all ranks are returned as a list.

The controller refuses to call a method that has no declaration, so a new role method cannot be
dispatched by accident with the wrong contract.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "__rlsp_dispatch__"


class Dispatch(enum.Enum):
    BY_DP = "by_dp"
    ALL = "all"


def register(mode: Dispatch) -> Callable[[F], F]:
    """Declare how the controller dispatches calls of the decorated method."""

    def decorator(fn: F) -> F:
        setattr(fn, _ATTR, mode)
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
