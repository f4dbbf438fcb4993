"""The longest sequence a cluster can train: a binary search over the length with the planner's search.

A length fits when `search` finds a fitting plan for it. Memory grows with the length (every term is
a non-decreasing function of the tokens per rank), so the fitting lengths form a prefix and a binary
search over multiples of LENGTH_GRANULE finds the longest one within one granule.
"""

from __future__ import annotations

import dataclasses

from rlsp.plan.search import Plan, Request, SplitFn, search

LENGTH_GRANULE = 1024  # lengths are searched in steps of this many tokens


def plan_at(req: Request, split_fn: SplitFn, seq_len: int) -> Plan | None:
    """The recommended plan for sequences of `seq_len` tokens, or None when nothing fits."""
    plans = search(dataclasses.replace(req, seq_len=seq_len), split_fn)
    return plans[0] if plans and plans[0].fits else None


def longest_length(req: Request, split_fn: SplitFn) -> tuple[int, Plan] | None:
    """(the longest length <= req.seq_len, in LENGTH_GRANULE steps, that fits; its recommended plan), or
    None when not even LENGTH_GRANULE tokens fit."""
    if req.seq_len < LENGTH_GRANULE:  # shorter than one step: that length or nothing
        short = plan_at(req, split_fn, req.seq_len)
        return None if short is None else (req.seq_len, short)
    lo, hi = 1, req.seq_len // LENGTH_GRANULE
    best = plan_at(req, split_fn, lo * LENGTH_GRANULE)
    if best is None:
        return None
    top = plan_at(req, split_fn, hi * LENGTH_GRANULE) if hi > lo else None
    if top is not None:
        return hi * LENGTH_GRANULE, top
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        plan = plan_at(req, split_fn, mid * LENGTH_GRANULE)
        if plan is None:
            hi = mid
        else:
            lo, best = mid, plan
    return lo * LENGTH_GRANULE, best
