"""Gemma 2, Gemma 3 and gpt-oss train exactly under ring attention: sliding-window, soft-capped and sink layers at
ring 2 and Ulysses 2 x ring 2.

The tiny models of tests/tiny_gemma.py (sliding and full layers, window 4 shorter than the rows and than a
zigzag chunk of the packed stream, so the window cuts boxes and skips blocks; 6 q / 2 kv heads; Gemma 2 with
attention and final-logit soft-capping; tests/tiny_gpt_oss.py: the same heads and window, attention sinks on every
layer, 4 tiny experts) go through the FSDP2 policy engine as tests/distributed/test_gemma_exact.py's
do: at ring 2 (world 2) and Ulysses 2 x ring 2 (world 4, heads 3+3 q, 1+1 kv) the loss metrics, every parameter's
full gradient (the sinks' included) and the AdamW step equal one process's, within tests/tolerances.py's bounds
for the model. The block math per element against the single-rank windowed kernel: tests/unit/test_ring_window.py.

Sends of windowed layers (rlsp/parallel/ring_direct.py): ring_attention itself at ring 4 (world 4), windows 3, 7,
1000 and none, against dense fp64 attention every element, v's head dim other than q/k's (multi-latent attention)
and equal: a window shorter than a zigzag chunk over one long sequence sends 6 of the relay's 12 K/V blocks (and
dK/dV parts); the counters ring_blocks_not_sent / ring_bytes_not_sent say so, and bytes sent plus bytes not sent
equal the relay's formula. A window the plan needs at every step (1000, longer than the stream) keeps the relay.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _launch import run_distributed
from test_fsdp_engine import B, _assert_same_step, _rollout_batch, _train_once
from tiny_gemma import FAMILIES, write_tiny_gemma
from tiny_gpt_oss import write_tiny_gpt_oss

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=(*FAMILIES, "gpt_oss"))
def gemma_ring_model_and_batch(request, tmp_path_factory):
    from transformers import AutoConfig

    out_dir = str(tmp_path_factory.mktemp(request.param))
    path = write_tiny_gpt_oss(out_dir) if request.param == "gpt_oss" else write_tiny_gemma(request.param, out_dir)
    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    return path, batch, reference


@pytest.mark.parametrize("world,ulysses,ring,micro", [(2, 1, 2, 3), (4, 2, 2, 2)])
def test_ring_keeps_gemma_loss_gradients_and_step_exact(gemma_ring_model_and_batch, world, ulysses, ring, micro):
    path, batch, reference = gemma_ring_model_and_batch
    got = run_distributed(_train_once, world, path, ulysses, micro, batch, None, -1, ring)[0]
    _assert_same_step(got, reference, path)


KERNEL_CASES = [  # (segment lengths, window, Dk, Dv, K/V blocks ranks 0..3 do not send per forward call or None)
    # window < chunk (5): a block goes only to the holders of the chunks after its two chunks (module docstring of
    # rlsp/parallel/ring_direct.py): 2r - 2 = 6 of the relay's r(r-1) = 12 blocks travel
    ((40,), 3, 8, 6, (2, 1, 1, 2)),
    ((40,), 3, 8, 8, (2, 1, 1, 2)),
    ((7, 13, 1, 5, 10, 4), 3, 6, 10, None),  # packed: what the plan's table says
    ((40,), 7, 8, 6, None),  # window spans a chunk: fewer blocks stay home
    ((40,), 1000, 8, 6, (0, 0, 0, 0)),  # window longer than the stream: every step needed, the relay
    ((7, 13, 1, 5, 10, 4), None, 8, 6, (0, 0, 0, 0)),  # no window: the relay with the fused kernels, Dv != Dk
]
HQ, HKV = 4, 2


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _stream(lens, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(sum(lens), h, d) for h, d in ((HQ, dk), (HKV, dk), (HKV, dv), (HQ, dv))]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _window_worker(rank, world_size):
    from rlsp.parallel.ring import ring_attention
    from rlsp.parallel.ring_plan import build_ring_plan, zigzag_indices
    from rlsp.parallel.ulysses import SPStats

    out = []
    for n, (lens, window, dk, dv, _) in enumerate(KERNEL_CASES):
        plan = build_ring_plan(dist.group.WORLD, _cu(lens), sum(lens))
        rows = zigzag_indices(plan.total_len, plan.ring_size, plan.ring_rank)
        q, k, v, do = (x[rows].clone().requires_grad_() for x in _stream(lens, dk, dv, n))
        stats = SPStats()
        o = ring_attention(q, k, v, plan, dk**-0.5, stats=stats, window=window)
        o.backward(do.detach())
        out.append({"rows": rows, "o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "stats": stats})
    return out


def _dense(lens, window, dk, dv, seed):
    q, k, v, do = _stream(lens, dk, dv, seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(sum(lens))
    band = window or sum(lens)
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - band)
    index = torch.arange(HQ) // (HQ // HKV)
    scores = torch.einsum("qhd,khd->hqk", q, k[:, index]) * dk**-0.5
    o = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1), v[:, index])
    o.backward(do)
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def test_windowed_ring_sends_only_needed_blocks_and_stays_exact():
    from tolerances import roundoff_rtol

    from rlsp.parallel.ring_plan import offline_plans

    ring = 4
    results = run_distributed(_window_worker, ring)
    for n, (lens, window, dk, dv, unsent) in enumerate(KERNEL_CASES):
        ref, total = _dense(lens, window, dk, dv, n), sum(lens)
        rtol = roundoff_rtol(reduction=total, stages=8, dtype=torch.float64)
        relay_fwd = (ring - 1) * (total // ring) * HKV * (dk + dv) * 8
        plans = offline_plans(_cu(lens), total, ring)
        for rank, res in enumerate(results):
            got = res[n]
            for name in ("o", "dq", "dk", "dv"):
                want = ref[name][got["rows"]]
                err = (got[name] - want).abs().max().item()
                assert err <= rtol * max(want.abs().max().item(), 1.0), f"case {n} rank {rank} {name}: {err:.3g}"
            stats, needs = got["stats"], plans[rank].step_needs(window)
            relay = window is None  # full layers relay every block (the table would allow fewer: not taken)
            expect = 0 if relay else sum(1 for s in range(1, ring) if not needs[(rank + s) % ring][s])
            assert stats.ring_blocks_not_sent == expect and (unsent is None or expect == unsent[rank]), (n, rank)
            block = relay_fwd // (ring - 1)
            assert stats.ring_bytes_fwd == relay_fwd - expect * block, (n, rank)
            # backward: the same K/V sends, and a dK/dV part (fp64 like the inputs) for each block this rank saw
            own_unseen = 0 if relay else sum(1 for s in range(1, ring) if not needs[rank][s])
            assert stats.ring_bytes_not_sent == (2 * expect + own_unseen) * block, (n, rank)
            assert stats.ring_bytes_fwd + stats.ring_bytes_bwd + stats.ring_bytes_not_sent == 3 * relay_fwd, (n, rank)
    assert sum(r[2]["stats"].ring_blocks_not_sent for r in results) >= ring  # packed: some blocks stay home
