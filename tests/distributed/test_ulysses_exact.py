"""Ulysses SP is exact: logprobs and parameter gradients at sp=2/4 equal sp=1 (fp32, CPU, gloo).

Every rank builds the same tiny Qwen2 (same seed), computes the sp=1 reference locally on the full
packed stream (group=None, same code path), then the sharded run over the gloo group. Gradients of
the sharded run are summed over the sp group (what FSDP does with the divide factor off) and
compared per parameter. The packed batch has several sequences with lengths not divisible by sp,
a left+right padded row and an empty row.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_distributed  # noqa: E402

from rlsp.data.packing import PackedBatch, pack_sequences  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.ulysses import SPContext, build_sp_context, gather_from_ranks, shard_for_rank  # noqa: E402

LOGPROB_ATOL = 1e-5
GRAD_RTOL = 1e-5
VOCAB = 50
NUM_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class Case:
    q_heads: int
    kv_heads: int
    sp: int
    tie: bool = False
    row_lens: tuple[int, ...] = (7, 13, 0, 5, 10)  # 35 real tokens; 0 = empty row
    corrupt_kv: bool = False


def _model(case: Case) -> TokenLogprobModel:
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=case.q_heads, num_key_value_heads=case.kv_heads, head_dim=8,
        tie_word_embeddings=case.tie, initializer_range=0.2,
    )
    torch.manual_seed(0)
    return TokenLogprobModel(build_causal_lm_from_config(config))


def _batch(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows placed at different offsets so that some are left- and right-padded."""
    gen = torch.Generator().manual_seed(1)
    width = max(case.row_lens) + 3
    ids_BL = torch.randint(1, VOCAB, (len(case.row_lens), width), generator=gen)
    mask_BL = torch.zeros_like(ids_BL)
    for b, n in enumerate(case.row_lens):
        offset = b % 3
        mask_BL[b, offset : offset + n] = 1
    return ids_BL, mask_BL


def _run(model: TokenLogprobModel, packed: PackedBatch, ctx: SPContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Local logprobs and entropies [S, 2] and parameter grads of a weighted sum over local tokens."""
    gen = torch.Generator().manual_seed(2)
    w_lp_T = torch.randn(packed.total_len, generator=gen) * packed.label_mask
    w_ent_T = torch.randn(packed.total_len, generator=gen)
    model.zero_grad(set_to_none=True)
    lp_S, ent_S = model(
        shard_for_rank(packed.input_ids, ctx), shard_for_rank(packed.position_ids, ctx),
        shard_for_rank(packed.labels, ctx), ctx, temperature=0.7, with_entropy=True,
    )
    loss = (shard_for_rank(w_lp_T, ctx) * lp_S).sum() + 0.1 * (shard_for_rank(w_ent_T, ctx) * ent_S).sum()
    loss.backward()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return torch.stack([lp_S, ent_S], dim=1).detach(), grads


def _worker(rank: int, world: int, case: Case) -> dict[str, Any]:
    model = _model(case)
    ids_BL, mask_BL = _batch(case)
    packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=world)
    ref_T2, ref_grads = _run(model, packed, build_sp_context(None, packed, case.q_heads, case.kv_heads))

    ctx = build_sp_context(dist.group.WORLD, packed, case.q_heads, case.kv_heads)
    if case.corrupt_kv:  # every rank reads the kv heads meant for its neighbour
        kv = ctx.layout.kv_ranges
        ctx.layout = dataclasses.replace(ctx.layout, kv_ranges=kv[1:] + kv[:1])
    local_S2, grads = _run(model, packed, ctx)
    full_T2 = gather_from_ranks(local_S2, ctx)
    rel = {}
    for name, g in grads.items():
        dist.all_reduce(g)
        rel[name] = ((g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-30)).item()
    return {
        "lp_err": (full_T2[:, 0] - ref_T2[:, 0]).abs().max().item(),
        "ent_err": (full_T2[:, 1] - ref_T2[:, 1]).abs().max().item(),
        "grad_rel": rel,
        "stats": dataclasses.asdict(ctx.stats),
        "num_real": packed.num_real,
        "total": packed.total_len,
    }


CASES = {
    "4q2kv_sp4_kv_lt_sp": Case(4, 2, 4),
    "8q4kv_sp2_kv_ge_sp": Case(8, 4, 2),
    "6q2kv_sp4_uneven": Case(6, 2, 4),
    "6q6kv_sp4_q_not_divisible": Case(6, 6, 4),
    "10q2kv_sp4_q_not_divisible": Case(10, 2, 4),
    "2q1kv_sp4_idle_ranks": Case(2, 1, 4),
    "4q2kv_sp2_tied": Case(4, 2, 2, tie=True),
    "4q2kv_sp4_pure_padding_shard": Case(4, 2, 4, row_lens=(2, 0)),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CASES))
def test_sp_matches_sp1(name: str) -> None:
    case = CASES[name]
    results = run_distributed(_worker, case.sp, case)
    for rank, res in enumerate(results):
        assert res["total"] % case.sp == 0 and res["num_real"] == sum(case.row_lens)
        assert res["lp_err"] <= LOGPROB_ATOL, (rank, res["lp_err"])
        assert res["ent_err"] <= LOGPROB_ATOL, (rank, res["ent_err"])
        bad = {n: r for n, r in res["grad_rel"].items() if not r <= GRAD_RTOL}
        assert not bad, (rank, bad)
        # two all-to-alls per layer each way (the sp=1 reference issues none)
        assert res["stats"]["a2a_calls_fwd"] == 2 * NUM_LAYERS
        assert res["stats"]["a2a_calls_bwd"] == 2 * NUM_LAYERS
        assert res["stats"]["attn_calls"] == NUM_LAYERS
    if name.endswith("pure_padding_shard"):
        assert results[0]["num_real"] < case.sp


@pytest.mark.distributed
def test_corrupted_head_layout_is_caught() -> None:
    """A wrong kv mapping must show up as a large logprob difference (what a self-check relies on)."""
    results = run_distributed(_worker, 2, Case(8, 4, 2, corrupt_kv=True))
    assert max(res["lp_err"] for res in results) > 1e-2
