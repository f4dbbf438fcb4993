"""Ulysses SP is exact: logprobs and parameter gradients at sp=2/4 equal sp=1 (fp32, CPU, gloo).

Every rank builds the same tiny Qwen2 (same seed), computes the sp=1 reference locally on the full
packed stream (group=None, same code path), then the sharded run over the gloo group. Gradients of
the sharded run are summed over the sp group (what FSDP does with the divide factor off) and
compared per parameter. The packed batch has several sequences with lengths not divisible by sp,
a left+right padded row and an empty row. Bounds: tests/tolerances.py's `model_rtol` of the case's
model over its packed stream, in its dtype (`_tolerances`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_distributed  # noqa: E402
from tolerances import model_rtol, scalar_tol  # noqa: E402

from rlsp.data.packing import PackedBatch, pack_sequences  # noqa: E402
from rlsp.models.family_checks import check_ring_support, check_sp_support, num_heads  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.parallel.heads import HeadLayout  # noqa: E402
from rlsp.parallel.ulysses import SPContext, build_sp_context, gather_from_ranks, shard_for_rank  # noqa: E402

VOCAB = 50
NUM_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class Case:
    q_heads: int
    kv_heads: int
    sp: int
    tie: bool = False
    row_lens: tuple[int, ...] = (7, 13, 0, 5, 10)  # 35 real tokens; 0 = empty row
    dtype: torch.dtype = torch.float32
    corrupt: str | None = None  # None, 'kv_mapping' or 'head_order' (see _corrupt)
    conditioning: float = 1.0  # |terms| / |their sum| of the worst gradient, where that is not O(1)


def _model(case: Case) -> TokenLogprobModel:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=case.q_heads,
        num_key_value_heads=case.kv_heads,
        head_dim=8,
        tie_word_embeddings=case.tie,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return TokenLogprobModel(build_causal_lm_from_config(config, dtype=case.dtype))


def _tolerances(case: Case) -> tuple[float, float]:
    """(logprob and entropy abs bound, per-parameter ||dg|| / ||g|| bound): two computations of the case's
    model (the sharded and the sp=1 one) over its packed tokens, at a logprob's scale (log vocab)."""
    config, tokens = _model(case).lm.config, int(_batch(case)[1].sum()) + case.sp
    forward = model_rtol(config, tokens, backward=False, dtype=case.dtype)
    return scalar_tol(math.log(VOCAB), forward), case.conditioning * model_rtol(config, tokens, dtype=case.dtype)


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
    w_lp_T = torch.randn(packed.total_len, generator=gen, dtype=torch.float64) * packed.label_mask
    w_ent_T = torch.randn(packed.total_len, generator=gen, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    out = model(
        shard_for_rank(packed.input_ids, ctx),
        shard_for_rank(packed.position_ids, ctx),
        shard_for_rank(packed.labels, ctx),
        ctx,
        temperature=0.7,
        with_entropy=True,
    )
    lp_S, ent_S = out["logprobs"], out["entropy"]
    loss = (shard_for_rank(w_lp_T, ctx) * lp_S).sum() + 0.1 * (shard_for_rank(w_ent_T, ctx) * ent_S).sum()
    loss.backward()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return torch.stack([lp_S, ent_S], dim=1).detach(), grads


def _corrupt(layout: HeadLayout, mode: str, rank: int) -> HeadLayout:
    """Deliberately broken layouts (sp=2, 8q/4kv). A layout shared by all ranks is self-consistent
    for the kv mapping, so a wrong mapping needs ranks that disagree: in 'kv_mapping' rank 0 sends
    rank 1 the kv heads of rank 0 (same count, so shapes still fit). In 'head_order' all ranks
    swap their q and kv ranges, so attention is right per head but heads come back permuted."""
    if mode == "kv_mapping":
        return layout if rank != 0 else dataclasses.replace(layout, kv_ranges=(layout.kv_ranges[0],) * 2)
    if mode == "head_order":
        return dataclasses.replace(layout, q_ranges=layout.q_ranges[::-1], kv_ranges=layout.kv_ranges[::-1])
    raise ValueError(f"unknown corruption {mode!r}")


def _worker(rank: int, world: int, case: Case) -> dict[str, Any]:
    model = _model(case)
    ids_BL, mask_BL = _batch(case)
    packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=world)
    ref_T2, ref_grads = _run(model, packed, build_sp_context(None, packed, case.q_heads, case.kv_heads))

    ctx = build_sp_context(dist.group.WORLD, packed, case.q_heads, case.kv_heads)
    if case.corrupt is not None:
        ctx.layout = _corrupt(ctx.layout, case.corrupt, rank)
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
    # 2 real tokens for 4 ranks: ranks 2 and 3 hold only padding. With sequences of 1-2 tokens the
    # q/k gradients are small differences of O(1) terms, so fp32 roundoff relative to them is
    # ~1e-5; the case runs in fp64, where any systematic error would stand out by many digits. Their
    # terms are ~1e2 times their difference (measured: 16x the well-conditioned bound, 0.16 of this one).
    "4q2kv_sp4_pure_padding_shard": Case(4, 2, 4, row_lens=(2, 0), dtype=torch.float64, conditioning=1e2),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CASES))
def test_sp_matches_sp1(name: str) -> None:
    case = CASES[name]
    results = run_distributed(_worker, case.sp, case)
    lp_atol, grad_rtol = _tolerances(case)  # measured: logprobs <= 0.03, gradients <= 0.03 (padding case 0.16)
    for rank, res in enumerate(results):
        assert res["total"] % case.sp == 0 and res["num_real"] == sum(case.row_lens)
        assert res["lp_err"] <= lp_atol, (rank, res["lp_err"])
        assert res["ent_err"] <= lp_atol, (rank, res["ent_err"])
        bad = {n: r for n, r in res["grad_rel"].items() if not r <= grad_rtol}
        assert not bad, (rank, bad)
        # two all-to-alls per layer each way (the sp=1 reference issues none)
        assert res["stats"]["a2a_calls_fwd"] == 2 * NUM_LAYERS
        assert res["stats"]["a2a_calls_bwd"] == 2 * NUM_LAYERS
        assert res["stats"]["attn_calls"] == NUM_LAYERS
    if name.endswith("pure_padding_shard"):
        assert results[0]["num_real"] < case.sp


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["kv_mapping", "head_order"])
def test_corrupted_head_layout_is_caught(mode: str) -> None:
    """A broken layout must show up as a large logprob difference (what a self-check relies on)."""
    results = run_distributed(_worker, 2, Case(8, 4, 2, corrupt=mode))
    assert max(res["lp_err"] for res in results) > 1e-2, [res["lp_err"] for res in results]


# Single-process checks of the same stack (sp=1, no process group): guards and the HF reference.


def test_sp1_matches_hf_sdpa_on_padded_rows() -> None:
    """The rlsp_ulysses path at sp=1 on a packed stream equals stock HF sdpa attention run per row."""
    case = Case(4, 2, 1)
    model = _model(case)
    reference = build_causal_lm_from_config(model.lm.config, attn_implementation="sdpa")
    reference.load_state_dict(model.lm.state_dict())
    ids_BL, mask_BL = _batch(case)
    packed = pack_sequences(ids_BL, mask_BL, pad_to_multiple=3)
    ctx = build_sp_context(None, packed, 4, 2)
    with torch.no_grad():
        lp_T = model(packed.input_ids, packed.position_ids, packed.labels, ctx)["logprobs"]
        for b in range(ids_BL.shape[0]):
            tokens = ids_BL[b][mask_BL[b].bool()]
            if tokens.numel() < 2:
                continue
            logp = torch.log_softmax(reference(input_ids=tokens[None]).logits[0].double(), dim=-1)
            expected = logp[:-1].gather(-1, tokens[1:, None])[:, 0]
            stream_pos = (packed.row_index == b).nonzero()[:-1, 0]
            torch.testing.assert_close(lp_T[stream_pos].double(), expected, atol=_tolerances(case)[0], rtol=0)


def test_missing_context_and_wrong_attention_are_refused() -> None:
    model = _model(Case(4, 2, 1))
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(RuntimeError, match="sp_context"):
        model.lm.model(input_ids=ids, position_ids=torch.arange(3)[None])
    sdpa = TokenLogprobModel(build_causal_lm_from_config(model.lm.config, attn_implementation="sdpa"))
    packed = pack_sequences(ids, torch.ones_like(ids))
    with pytest.raises(RuntimeError, match="did not go through rlsp_ulysses in 2 of 2 layers"):
        sdpa(packed.input_ids, packed.position_ids, packed.labels, build_sp_context(None, packed, 4, 2))


def test_sliding_window_refused_outside_verified_families_and_by_ring() -> None:
    """Windowed layers run in rlsp_ulysses for the verified families (tests/unit/test_window_attention.py,
    tests/distributed/test_gemma_exact.py); other families' stay refused, and ring refuses them by name."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
    )
    with pytest.raises(ValueError, match="qwen2: sliding_attention layers .* verified exact .* for .*gemma2"):
        check_sp_support(config, 2)
    with pytest.raises(ValueError, match="ring_sequence_parallel_size=2: qwen2 has sliding-window layers"):
        check_ring_support(config, 2)
    check_ring_support(config, 1)


def test_check_sp_support_rejects_unsupported_configs() -> None:
    ok = Qwen2Config(num_attention_heads=40, num_key_value_heads=8)
    for sp in (1, 3, 5, 16, 64):
        check_sp_support(ok, sp)  # any sp: uneven head splits are supported
    assert num_heads(ok) == (40, 8)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_sp_support(GPT2Config(), 2)
    with pytest.raises(ValueError, match="linear_attention"):
        check_sp_support(Qwen2Config(layer_types=["full_attention", "linear_attention"], num_hidden_layers=2), 2)
    scaled = Qwen2Config()
    scaled.logit_scale = 0.5
    with pytest.raises(ValueError, match="scaled output logits"):
        check_sp_support(scaled, 2)
    with pytest.raises(ValueError, match="sp_size"):
        check_sp_support(ok, 0)
