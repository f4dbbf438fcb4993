"""Head groups of ring attention's backward: the rule that bounds its fp32 (fp64) accumulators.

The backward (rlsp/parallel/ring.py) holds, per rank, a dq accumulator [Tr, hq, D] and three dK/dV
accumulators [2, Tr, hkv, D] (its own block's, the visiting block's, the receive buffer), all in the
accumulation dtype: (hq + 6 * hkv) * Tr * D * e_acc bytes, 17.9 GiB for 32 q / 8 kv heads, D 128 and
469k tokens a rank. Heads are independent in attention, so the backward runs as G passes over groups
of heads, one after another: group g holds kv heads [g*n, (g+1)*n) and the q heads that read them
(q heads [g*n*m, (g+1)*n*m), m = hq / hkv, in the standard grouped order), each pass a full ring
backward of its own; a finished group's dq/dk/dv are written into the output gradients in the input
dtype. Only one group's accumulators (and K/V blocks in flight) exist at a time.

Rule (`kv_heads_per_pass`): n is the largest divisor of hkv whose accumulators,
(n*m + 6*n) * Tr * D * e_acc bytes, fit `bound` (RING_BWD_ACC_BYTES unless the caller passes one),
and at least 1 (one kv head and its m q heads cannot be split further). Below the bound (every
problem of up to 26k tokens a rank for 32 q / 8 kv heads, D 128) that is n = hkv: one pass, the
backward as it always was. The groups are equal and depend only on shapes, so every rank of a ring
runs the same passes. A caller's own kv_index (a rank whose q heads do not start a GQA group) or
hq not a multiple of hkv: one pass (n = hkv).

Communication, bytes sent by a rank in the backward (r > 1), G = hkv / n passes:
  G * (r-1) * 2*Tr*n*D * (e_in + e_acc) = (r-1) * 2*Tr*hkv*D * (e_in + e_acc)   (the same total)
in G * 2*(r-1) point-to-point batches instead of 2*(r-1) (G times the messages, each 1/G the size).

Legend: Tr tokens of a rank, hq / hkv its q / kv heads, D head dim, r ring size, e_in / e_acc element
sizes of the inputs and of the accumulators (4; 8 for fp64 inputs).
"""

from __future__ import annotations

from typing import NamedTuple

RING_BWD_ACC_BYTES = 2**30  # the backward's accumulators of one head group at most, unless one kv head needs more
ACC_BUFFERS_PER_KV_HEAD = 6  # dK and dV, in three accumulators (own, visiting, receive), per kv head


class HeadGroup(NamedTuple):
    """Heads of one backward pass: q heads [q0, q1) read kv heads [kv0, kv1)."""

    q: slice
    kv: slice


def check_bound(bound: int) -> None:
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
        raise ValueError(f"acc_bytes_bound={bound!r}: must be a positive int (bytes of the backward's fp32 "
                         f"accumulators per head group; default RING_BWD_ACC_BYTES={RING_BWD_ACC_BYTES})")


def acc_bytes(tokens: int, q_heads: int, kv_heads: int, head_dim: int, elem: int) -> int:
    """Bytes of the backward's accumulators for `q_heads` / `kv_heads` heads: dq and three dK/dV."""
    return tokens * head_dim * elem * (q_heads + ACC_BUFFERS_PER_KV_HEAD * kv_heads)


def kv_heads_per_pass(tokens: int, hq: int, hkv: int, head_dim: int, elem: int, bound: int = RING_BWD_ACC_BYTES,
                      standard: bool = True) -> int:
    """n: kv heads per backward pass (module docstring); hkv (one pass) when the heads cannot be grouped."""
    check_bound(bound)
    if not standard or hkv < 2 or hq % hkv != 0:
        return hkv
    m = hq // hkv
    fits = [n for n in range(1, hkv + 1) if hkv % n == 0 and acc_bytes(tokens, n * m, n, head_dim, elem) <= bound]
    return max(fits, default=1)


def head_groups(hq: int, hkv: int, kv_per_pass: int) -> list[HeadGroup]:
    """The passes' heads, in order: `kv_per_pass` kv heads and their hq / hkv q heads each."""
    if kv_per_pass >= hkv:
        return [HeadGroup(slice(0, hq), slice(0, hkv))]
    n, m = kv_per_pass, hq // hkv
    return [HeadGroup(slice(g * n * m, (g + 1) * n * m), slice(g * n, (g + 1) * n)) for g in range(hkv // n)]
