"""Tensor parallelism is exact: per-token outputs and every parameter gradient under tp=2 (with and
without sequence-parallel activations, with dp and with Ulysses sp around it) equal the
single-process model's (fp32, CPU, gloo).

Every rank builds the same tiny Qwen2 (same seed), keeps an untouched copy as the reference and
runs it on the whole packed stream; the parallel copy gets `apply_tensor_parallel` (and FSDP2 on the
dp sub-mesh where there is one). The loss is rlsp's: each rank sums weight * output over the tokens
it owns and divides by the global token count; gradients are summed over ranks (FSDP2 with the
divide factor off over dp, an explicit all-reduce over a bare Ulysses group). Tolerances: outputs and
gradients (relative per parameter, and the gradient norm) within the bounds tests/tolerances.py derives
for the model and the packed stream (`_tolerances`); parameters after an AdamW step within its
`adam_step_bound` (AdamW amplifies the roundoff of gradient elements near its eps by up to lr / eps,
which differs between CPUs); one case runs in fp64 under the same derivation, where any systematic
error would show.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate
from transformers import GPT2Config, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_distributed  # noqa: E402
from tolerances import adam_step_bound, model_rtol, scalar_tol  # noqa: E402

from rlsp.data.packing import PackedBatch, pack_sequences  # noqa: E402
from rlsp.models.lm import TokenLogprobModel  # noqa: E402
from rlsp.models.loading import build_causal_lm_from_config  # noqa: E402
from rlsp.models.value import ValueModel  # noqa: E402
from rlsp.parallel.tensor_parallel import apply_tensor_parallel, reduce_tp_replicated_grads  # noqa: E402
from rlsp.parallel.tp_checks import check_tp_support, legal_tp_sizes, local_head_counts  # noqa: E402
from rlsp.parallel.ulysses import build_sp_context, shard_for_rank  # noqa: E402

VOCAB, Q_HEADS, KV_HEADS = 50, 4, 2
ROWS = (7, 13, 0, 5, 10, 9)  # tokens per row (0 = empty row); rows go round-robin to dp ranks


@dataclasses.dataclass(frozen=True)
class Case:
    tp: int = 2
    dp: int = 1
    sp: int = 1  # Ulysses degree (the sp group = ranks with the same dp and tp rank)
    sequence_parallel: bool = True
    tie: bool = False
    critic: bool = False
    step: bool = False  # also compare one AdamW step (on the FSDP2-wrapped model)
    dtype: torch.dtype = torch.float32

    @property
    def world(self) -> int:
        return self.dp * self.sp * self.tp

    @property
    def fsdp(self) -> bool:
        return self.dp > 1 or self.step


def _config(case: Case) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS, head_dim=8, tie_word_embeddings=case.tie, initializer_range=0.2,
    )


def _tolerances(case: Case) -> tuple[float, float]:
    """(output rtol, gradient rtol) of the model over the whole stream (tests/tolerances.py)."""
    tokens = sum(ROWS) + 3 * len(ROWS)  # every row's tokens plus pack padding: an upper bound
    return (model_rtol(_config(case), tokens, backward=False, dtype=case.dtype),
            model_rtol(_config(case), tokens, dtype=case.dtype))


def _model(case: Case) -> torch.nn.Module:
    config = _config(case)
    torch.manual_seed(0)
    lm = build_causal_lm_from_config(config, dtype=case.dtype)
    return ValueModel(lm.model, init_std=0.5) if case.critic else TokenLogprobModel(lm)


def _pack(dp_rank: int, case: Case) -> PackedBatch:
    """This dp rank's rows, placed at different offsets (left/right padding) and packed."""
    gen = torch.Generator().manual_seed(1)
    ids_BL = torch.randint(1, VOCAB, (len(ROWS), max(ROWS) + 3), generator=gen)
    mask_BL = torch.zeros_like(ids_BL)
    for b, n in enumerate(ROWS):
        mask_BL[b, b % 3 : b % 3 + n] = 1
    rows = list(range(dp_rank, len(ROWS), case.dp))
    return pack_sequences(ids_BL[rows], mask_BL[rows], pad_to_multiple=case.sp * case.tp)


def _weights(packed: PackedBatch, dp_rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 + dp_rank)
    return torch.randn(packed.total_len, generator=gen) * packed.label_mask


def _output(model: torch.nn.Module, inputs: list[torch.Tensor], ctx: Any, critic: bool) -> torch.Tensor:
    if critic:
        return model(*inputs, ctx)["values"]
    return model(*inputs, ctx, temperature=0.7)["logprobs"]


def _reference(model: torch.nn.Module, case: Case, n_global: float) -> tuple[list[torch.Tensor], dict]:
    """Single-process outputs per dp pack and gradients of the loss over every pack."""
    outs = []
    for d in range(case.dp):
        packed = _pack(d, case)
        ctx = build_sp_context(None, packed, Q_HEADS, KV_HEADS)
        out_T = _output(model, [packed.input_ids, packed.position_ids, packed.labels], ctx, case.critic)
        (out_T * _weights(packed, d)).sum().div(n_global).backward()
        outs.append(out_T.detach())
    return outs, {n: p.grad.clone() for n, p in model.named_parameters()}


def _apply_fsdp(model: torch.nn.Module, dp_mesh: Any) -> None:
    """FSDP2 over dp as rlsp's engine applies it (per layer + root, gradients summed, not averaged)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    units = [*model.decoder.layers, model]
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy)
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


def _grads_after_backward(model: torch.nn.Module, case: Case, mesh: Any) -> tuple[dict, set[str], set[str]]:
    """Full gradients summed as the engine would, plus (tp-replicated params, those with Partial grads)
    of a model without FSDP; FSDP2 sums Partial gradients over tp itself, a bare TP model needs the step."""
    replicated, partial = set(), set()
    if not case.fsdp:
        replicated = {n for n, p in model.named_parameters() if p.placements == (Replicate(),)}
        partial = {n for n, p in model.named_parameters() if p.grad.placements == (Partial(),)}
        assert reduce_tp_replicated_grads(model) == len(partial)
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    if case.sp > 1:  # what FSDP over the sp ranks would do: sum their gradients
        for g in grads.values():
            dist.all_reduce(g, group=mesh["sp"].get_group())
    return grads, replicated, partial


def _worker(rank: int, world: int, case: Case) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = _model(case)
    model = copy.deepcopy(reference)
    n_global = float(sum(_pack(d, case).label_mask.sum() for d in range(case.dp)))
    ref_outs, ref_grads = _reference(reference, case, n_global)

    mesh = init_device_mesh("cpu", (case.dp, case.sp, case.tp), mesh_dim_names=("dp", "sp", "tp"))
    dp_rank, sp_rank, tp_rank = (mesh.get_local_rank(d) for d in ("dp", "sp", "tp"))
    apply_tensor_parallel(model, mesh["tp"], case.sequence_parallel)
    if case.fsdp:
        _apply_fsdp(model, mesh["dp"])
    packed = _pack(dp_rank, case)
    hq, hkv = local_head_counts(model.decoder.config, case.tp)
    ctx = build_sp_context(mesh["sp"].get_group() if case.sp > 1 else None, packed, hq, hkv)
    inputs = [shard_for_rank(x, ctx) for x in (packed.input_ids, packed.position_ids, packed.labels)]
    with torch.no_grad():  # the inference path (old/ref logprobs, values) gives the same outputs
        out_no_grad = _output(model, inputs, ctx, case.critic)
    out = _output(model, inputs, ctx, case.critic)
    weights = model.tp_info.local_tokens(shard_for_rank(_weights(packed, dp_rank), ctx))
    (out * weights).sum().div(n_global).backward()
    grads, replicated, partial = _grads_after_backward(model, case, mesh)

    # stream position of this rank's first output token, to compare with the reference stream
    start = sp_rank * ctx.local_len + (tp_rank * out.shape[0] if case.sequence_parallel else 0)
    out = out.detach()
    return {
        "out_err": (out - ref_outs[dp_rank][start : start + out.shape[0]]).abs().max().item(),
        "out_scale": max(o.abs().max().item() for o in ref_outs),
        "no_grad_equal": torch.equal(out_no_grad, out),
        "out_len": out.shape[0],
        "stream_len": packed.total_len,
        "replicated": replicated,
        "partial_grads": partial,
        "names": sorted(grads) == sorted(ref_grads),
        "min_ref_grad": min(g.norm().item() for g in ref_grads.values()),
        "grad_rel": {n: ((g - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n, g in grads.items()},
        "step_err": _step_error(model, reference) if case.step else {},
    }


LR, ADAM_EPS = 1e-3, 1e-8  # AdamW's eps is torch's default


def _step_error(model: torch.nn.Module, reference: torch.nn.Module) -> dict[str, float]:
    """Gradient norm (as the engine clips) and one AdamW step on the parallel model (DTensor params)
    and on the reference: the norm's relative error, and per parameter the max of |difference after
    the step| / `adam_step_bound` (<= 1 when the step is the reference's for the given gradients).

    lr is 1e-3: a misplaced or missing update is off by ~lr, far above the bound except where the two
    gradients straddle 0 within ~eps (see tests/tolerances.py)."""
    norms = [_full(torch.nn.utils.clip_grad_norm_(list(m.parameters()), float("inf"))) for m in (model, reference)]
    for m in (model, reference):
        torch.optim.AdamW(m.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.1).step()
    ref = dict(reference.named_parameters())
    ratios = {}
    for n, p in model.named_parameters():
        err = (_full(p.detach()) - ref[n].detach()).abs()
        ratios[n] = (err / adam_step_bound(_full(p.grad), ref[n].grad, ref[n].detach(), LR, ADAM_EPS)).max().item()
    return {"grad_norm_rel": (norms[0] / norms[1] - 1).abs().item(), **ratios}


def _check(case: Case, results: list[dict[str, Any]]) -> None:
    out_rtol, grad_rtol = _tolerances(case)
    for rank, res in enumerate(results):
        expected_len = res["stream_len"] // case.sp // (case.tp if case.sequence_parallel else 1)
        assert res["out_len"] == expected_len, (rank, res["out_len"], expected_len)
        assert res["out_err"] <= scalar_tol(res["out_scale"], out_rtol), (rank, res["out_err"], res["out_scale"])
        assert res["no_grad_equal"], rank
        assert res["names"] and res["min_ref_grad"] > 0, rank
        bad = {n: r for n, r in res["grad_rel"].items() if not r <= grad_rtol}
        assert not bad, (rank, bad, grad_rtol)
        bad = {n: e for n, e in res["step_err"].items() if not e <= (grad_rtol if n == "grad_norm_rel" else 1.0)}
        assert not bad and bool(res["step_err"]) == case.step, (rank, bad)


CASES = {
    "tp2_seqpar": Case(),
    "tp2_seqpar_tied": Case(tie=True),
    "tp2_no_seqpar": Case(sequence_parallel=False),
    "tp2_no_seqpar_tied": Case(sequence_parallel=False, tie=True),
    "critic_tp2_seqpar": Case(critic=True),
    "tp2_seqpar_fp64": Case(dtype=torch.float64),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_matches_single_process(name: str) -> None:
    case = CASES[name]
    results = run_distributed(_worker, case.world, case)
    _check(case, results)
    # Under sequence parallelism every tp-replicated parameter gets a Partial gradient (its tokens'
    # share; summed by FSDP2 or reduce_tp_replicated_grads), without it none does (complete on every rank).
    for res in results:
        assert res["replicated"] and res["partial_grads"] == (res["replicated"] if case.sequence_parallel else set())


@pytest.mark.distributed
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_dp2_tp2_fsdp_grads_and_adamw_step(tie: bool) -> None:
    case = Case(dp=2, tie=tie, step=True)
    _check(case, run_distributed(_worker, case.world, case))


@pytest.mark.distributed
def test_sp2_tp2_ulysses_inside_tp() -> None:
    case = Case(sp=2)
    _check(case, run_distributed(_worker, case.world, case))


def test_check_tp_support_legal_and_illegal_sizes() -> None:
    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    assert legal_tp_sizes(config) == [1, 2]
    for tp in (1, 2):
        check_tp_support(config, tp)
    assert local_head_counts(config, 2) == (2, 1)
    with pytest.raises(ValueError) as err:
        check_tp_support(config, 3)
    assert str(err.value) == (
        "tensor_model_parallel_size=3 does not divide 4 q heads / 2 kv heads / intermediate_size 64; "
        "legal tensor_model_parallel_size for this model: 1, 2"
    )
    for bad in (0, 4, -2, 2.0):
        with pytest.raises(ValueError, match="legal tensor_model_parallel_size for this model: 1, 2"):
            check_tp_support(config, bad)
    wide = Qwen2Config(num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944)
    assert legal_tp_sizes(wide) == [1, 2, 4]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tp_support(GPT2Config(), 2)
