"""Ring attention's backward over head groups (rlsp/parallel/ring_heads.py): the grouping rule against
values worked out by hand, and ring_attention (ring size 1) with the backward forced into several
groups against dense fp64 attention, every element (within tests/tolerances.py's bounds as
test_ring_block derives them for the attention's reductions), on the fused kernels and on the explicit path. Rings of 2 and 4: tests/distributed/test_ring_grouped_backward.py."""

from __future__ import annotations

import pytest
import torch
from test_ring_block import _assert_close
from test_ring_block import tolerances as attention_tolerances

import rlsp.parallel.ring as ring_module
from rlsp.parallel.ring import ring_attention
from rlsp.parallel.ring_heads import RING_BWD_ACC_BYTES, HeadGroup, acc_bytes, head_groups, kv_heads_per_pass
from rlsp.parallel.ring_plan import build_ring_plan

LENS = (7, 13, 1, 5, 10, 4)  # 40 tokens, the last segment stands for the padding tail
D = 8


def test_accumulator_bytes_by_hand() -> None:
    # dq [Tr, hq, D] + three [2, Tr, hkv, D] in fp32: 469k tokens, 32 q / 8 kv heads, D 128 -> 17.9 GiB
    assert acc_bytes(468_750, 32, 8, 128, 4) == 468_750 * 128 * 4 * (32 + 48) == 19_200_000_000
    assert acc_bytes(10, 3, 1, 8, 8) == 10 * 8 * 8 * 9


def test_rule_picks_the_largest_divisor_that_fits() -> None:
    # Llama-3.1-8B heads (32 q / 8 kv, D 128, fp32): all 8 kv heads take 40,960 bytes a token, so one
    # pass up to 2**30 / 40,960 = 26,214.4 tokens; at 26,215 half the heads (20,480 B a token) fit
    assert kv_heads_per_pass(26_214, 32, 8, 128, 4) == 8
    assert kv_heads_per_pass(26_215, 32, 8, 128, 4) == 4
    assert kv_heads_per_pass(52_428, 32, 8, 128, 4) == 4  # 52,428 * 20,480 = 1,073,725,440 <= 2**30
    assert kv_heads_per_pass(52_429, 32, 8, 128, 4) == 2
    assert kv_heads_per_pass(468_750, 32, 8, 128, 4) == 1  # one kv head: 2.4e9 bytes, cannot be split
    # 6 kv heads: the divisors are 1, 2, 3, 6; a bound for 3 heads of 2 q each, (6 + 18) * 10 * 8 * 4 bytes
    assert kv_heads_per_pass(10, 12, 6, 8, 4, bound=24 * 10 * 8 * 4) == 3
    assert kv_heads_per_pass(10, 12, 6, 8, 4, bound=24 * 10 * 8 * 4 - 1) == 2
    assert kv_heads_per_pass(10, 12, 6, 8, 4, bound=1) == 1


def test_heads_that_cannot_be_grouped_run_in_one_pass() -> None:
    assert kv_heads_per_pass(10**6, 3, 1, 128, 4) == 1  # one kv head
    assert kv_heads_per_pass(10**6, 3, 2, 128, 4) == 2  # hq not a multiple of hkv
    assert kv_heads_per_pass(10**6, 8, 2, 128, 4, standard=False) == 2  # the caller's own kv_index
    assert kv_heads_per_pass(8, 8, 2, 8, 4) == 2  # small: below RING_BWD_ACC_BYTES
    assert RING_BWD_ACC_BYTES == 2**30


@pytest.mark.parametrize("bound", [0, -5, 1.5, True, "1"])
def test_bad_bound_is_refused(bound: object) -> None:
    with pytest.raises(ValueError, match=r"acc_bytes_bound=.*must be a positive int"):
        kv_heads_per_pass(10, 8, 2, 8, 4, bound=bound)  # type: ignore[arg-type]
    q = torch.zeros(40, 8, D)
    with pytest.raises(ValueError, match=r"acc_bytes_bound="):
        ring_attention(q, q[:, :2], q[:, :2], build_ring_plan(None, _cu(LENS), 40), 1.0,
                       acc_bytes_bound=bound)  # type: ignore[arg-type]


def test_head_groups_follow_the_grouped_order() -> None:
    assert head_groups(8, 2, 1) == [HeadGroup(slice(0, 4), slice(0, 1)), HeadGroup(slice(4, 8), slice(1, 2))]
    assert head_groups(12, 6, 2) == [HeadGroup(slice(2 * g * 2, 2 * (g + 1) * 2), slice(2 * g, 2 * g + 2))
                                     for g in range(3)]
    assert head_groups(3, 1, 1) == [HeadGroup(slice(0, 3), slice(0, 1))]
    assert head_groups(4, 4, 4) == [HeadGroup(slice(0, 4), slice(0, 4))]


def _cu(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, index: torch.Tensor) -> torch.Tensor:
    """Masked softmax over the whole packed stream in fp64; q head h reads kv head index[h]."""
    seg = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))
    pos = torch.arange(sum(LENS))
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k.index_select(1, index)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.index_select(1, index))


# (hq, hkv, kv heads per pass): 8q/2kv in groups of 1 kv head, MHA in groups of 1, 8q/4kv in groups of 2,
# and 3q/1kv (one kv head: one group whatever the bound)
CASES = [(8, 2, 1), (4, 4, 1), (8, 4, 2), (3, 1, 1)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hq, hkv, per_pass", CASES)
def test_grouped_backward_matches_dense_reference(hq: int, hkv: int, per_pass: int, dtype: torch.dtype,
                                                  fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not fused:  # the explicit score tiles, 3 rows at a time, as a device without a fused kernel runs
        monkeypatch.setattr(ring_module, "fused_supported", lambda device, dt: False)
        monkeypatch.setattr(ring_module, "ROW_CHUNK", 3)
    total, scale = sum(LENS), D**-0.5
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    q, k, v, do = (torch.randn(total, h, D, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = _dense(qr, kr, vr, scale, torch.arange(hq) // (hq // hkv))
    ref.backward(do)
    # the bound that admits exactly `per_pass` kv heads' accumulators (and not the next divisor's)
    bound = acc_bytes(total, per_pass * hq // hkv, per_pass, D, dtype.itemsize if dtype == torch.float64 else 4)
    passes = _spy_passes(monkeypatch)
    qt, kt, vt = (x.to(dtype).requires_grad_() for x in (q, k, v))
    out = ring_attention(qt, kt, vt, build_ring_plan(None, _cu(LENS), total), scale, acc_bytes_bound=bound)
    out.backward(do.to(dtype))
    assert passes == [(total, hq // (hkv // per_pass), per_pass)] * (hkv // per_pass)
    rtol_o, rtol_g = attention_tolerances(dtype)
    for name, got, want in (("o", out, ref), ("dq", qt.grad, qr.grad), ("dk", kt.grad, kr.grad),
                            ("dv", vt.grad, vr.grad)):
        assert got.dtype == dtype and got.shape == want.shape
        _assert_close(name, got, want.detach(), rtol_o if name == "o" else rtol_g, f"({dtype}, {hq}q/{hkv}kv)")


def _spy_passes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Record (rows, q heads, kv heads) of every ring backward pass, then run the real one."""
    passes: list[tuple[int, int, int]] = []
    real = ring_module._ring_backward

    def recording(do, q, k, *args):  # type: ignore[no-untyped-def]
        passes.append((q.shape[0], q.shape[1], k.shape[1]))
        return real(do, q, k, *args)

    monkeypatch.setattr(ring_module, "_ring_backward", recording)
    return passes


def test_default_bound_keeps_one_pass_and_kv_index_runs_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    total = sum(LENS)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(total, h, D, generator=gen).requires_grad_() for h in (4, 2, 2))
    passes = _spy_passes(monkeypatch)
    ring_attention(q, k, v, build_ring_plan(None, _cu(LENS), total), 1.0).sum().backward()
    # a given kv_index runs one pass even under a bound that would split the standard order
    ring_attention(q, k, v, build_ring_plan(None, _cu(LENS), total), 1.0, torch.tensor([0, 0, 1, 1]),
                   acc_bytes_bound=1).sum().backward()
    assert passes == [(total, 4, 2), (total, 4, 2)]


def test_planner_counts_one_head_group() -> None:
    """rlsp.plan.memory.ring_bytes with the runtime's rule, by hand: fp32 accumulators (dq + 3 dK/dV) and
    the K/V blocks (held + next) of one group, a tile's CUDA buffers (5 e + 4 bytes per row, q head, D),
    the boxes' positions (32 bytes a token a step)."""
    from rlsp.config.layout import RoleLayout, World
    from rlsp.plan.memory import HeadShare, Workload, ring_bytes

    # Llama-3.1-8B at 15M tokens on ring 32, bf16: 468,750 tokens a rank, one kv head (4 q heads) a group
    tr = 15_000_000 // 32
    w = Workload(RoleLayout(World(4, 8), ring=32), tr, 15_000_000, HeadShare(32, 8))
    want = tr * 128 * 4 * (4 + 6 * 1) + 2 * 2 * tr * 1 * 128 * 2 + 16_384 * 4 * 128 * (5 * 2 + 4) + 32 * tr * 32
    assert ring_bytes(w, 128, 2) == want
    # 8 q / 2 kv heads, D 64, 8k tokens a rank, fp32: small, one group of all heads (152.5 MiB, as before)
    w = Workload(RoleLayout(World(1, 2), ring=2), 8192, 16_384, HeadShare(8, 2))
    want = 8192 * 64 * 4 * (8 + 6 * 2) + 2 * 2 * 8192 * 2 * 64 * 4 + 8192 * 8 * 64 * (5 * 4 + 4) + 32 * 8192 * 2
    assert ring_bytes(w, 64, 4) == want == 152.5 * 2**20
