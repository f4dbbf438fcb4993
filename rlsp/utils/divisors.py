"""Divisors of a size: the legal values named when a degree or batch size does not divide what it splits."""

from __future__ import annotations


def divisors(n: int) -> list[int]:
    """Every d in 1..n with n % d == 0, ascending (empty for n < 1)."""
    return [d for d in range(1, n + 1) if n % d == 0]
