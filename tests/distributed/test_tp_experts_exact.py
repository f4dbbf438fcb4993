"""Expert tensor parallelism (rlsp.parallel.tp_experts): the routed experts split over tp by their width.

At tp 2 the layer plan gives every MoE family of tests/tiny_moe.py (2 layers, 4 experts of width 32) its routed
experts split: gate_up_proj `_StridedShard(1, split_factor=2)` (this rank's rows of the gate block and of the up
block), down_proj Shard(2), the shared experts split like an MLP, the router replicated; the exactness of those
families' steps at tp 2 (loss, every full gradient, the AdamW step, the expert load) is tests/distributed/
test_tp_moe_exact.py's. Here, in one tp 2 launch (sequence-parallel activations): the placements of every family;
a qwen2_moe whose expert width tp 2 does not split (36: 18 per rank, not a multiple of tp_experts.ALIGN) keeps
its routed experts replicated (shared expert split) and its step equals one process's; a tp rank's parameter bytes (qwen3_moe) are measured against tp 1, the routed
experts' exactly halved; the engine's checkpoint (save_engine: the split gate_up_proj written as contiguous pieces,
`convert_strided_state`) is read back by one process's engine and by a fresh tp 2 engine (load_engine) as the tp 2
engine's full weights and AdamW moments.
"""

from __future__ import annotations

import os

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import policy_engine
from test_moe_exact import _assert_same_step_and_load, margin_checked_batch, step_and_count
from tiny_moe import EXACT_SHAPE, MOE_FAMILIES, write_tiny_moe
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from rlsp.engine.checkpoint import load_engine, save_engine
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm

pytestmark = pytest.mark.distributed

ODD = dict(moe_intermediate_size=36)  # qwen2_moe experts of 18 per tp rank: not split (shared expert: 32)
SPLIT = {"experts.gate_up_proj": _StridedShard(1, split_factor=2), "experts.down_proj": Shard(2),
         "gate_proj.weight": Shard(0), "up_proj.weight": Shard(0), "down_proj.weight": Shard(1)}


def _placements(path: str, dims) -> dict[str, tuple]:
    """The tp placements of every MoE-block parameter of the decoder layers (before FSDP2)."""
    from rlsp.parallel.tensor_parallel import apply_tensor_parallel

    model = TokenLogprobModel(load_causal_lm(path, dtype=torch.float32))
    apply_tensor_parallel(model, dims.tp_mesh, dims.layout.sequence_parallel)
    return {n: tuple(p.placements) for n, p in model.decoder.layers.named_parameters() if ".mlp." in n}


def _bytes(path: str, dims) -> tuple[int, int]:
    """(this tp rank's parameter bytes of the decoder layers, of which routed experts) after the layer plan."""
    from rlsp.parallel.tensor_parallel import apply_tensor_parallel

    model = TokenLogprobModel(load_causal_lm(path, dtype=torch.float32))
    if dims.layout.tp > 1:
        apply_tensor_parallel(model, dims.tp_mesh, dims.layout.sequence_parallel)
    local = {n: getattr(p, "_local_tensor", p) for n, p in model.decoder.layers.named_parameters()}
    size = {n: t.numel() * t.element_size() for n, t in local.items()}
    return sum(size.values()), sum(v for n, v in size.items() if ".experts." in n)


def _moments(engine) -> dict[str, torch.Tensor]:
    """The AdamW first and second moments of the routed experts' gate_up_proj, whole: {name/key: tensor}."""
    out = {}
    for name, param in engine.module.named_parameters():
        for key, value in engine.optimizer.state[param].items() if "gate_up_proj" in name else ():
            if value.dim() > 0:
                out[f"{name}/{key}"] = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
    return out


def _refusal(path: str, dims) -> str:
    """SplitExpertsMoE applied by hand to a sparse block whose experts tp 2 does not split: the error it raises."""
    from torch.distributed.tensor.parallel import parallelize_module

    from rlsp.parallel.tp_experts import SplitExpertsMoE

    block = load_causal_lm(path, dtype=torch.float32).model.layers[0].mlp
    try:
        parallelize_module(block, dims.tp_mesh, SplitExpertsMoE(Replicate()))
    except ValueError as error:
        return str(error)
    return "no error"


def _run(rank: int, world: int, cases: dict, tp: int, ckpt: str | None):
    """tp 1: one process's step of the odd-width model and the bytes; tp 2: also the placements and a checkpoint."""
    dims = layout_dims(tp=tp)
    odd_path, odd_batch = cases["odd"]
    odd = step_and_count(policy_engine(odd_path, dims), dims, odd_batch, 3)
    sizes = _bytes(cases["qwen3_moe"][0], dims)
    if tp == 1:
        return odd, sizes
    plans = {family: _placements(path, dims) for family, (path, _) in cases.items()}
    engine = policy_engine(cases["qwen3_moe"][0], dims)
    step_and_count(engine, dims, cases["qwen3_moe"][1], 3)
    save_engine(engine, ckpt)  # the state turns the split gate_up_proj into contiguous pieces (EngineState)
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    moments = _moments(engine)
    again = policy_engine(cases["qwen3_moe"][0], dims)  # the same layout restored from the checkpoint
    load_engine(again, ckpt)
    restored = ({k: v.clone() for k, v in again.iter_full_params()}, _moments(again))
    refusal = _refusal(odd_path, dims)
    return (odd, sizes, plans, (params, moments), restored, refusal) if rank == 0 else None


def _read_back(rank: int, world: int, path: str, ckpt: str) -> tuple[dict, dict]:
    """One process's engine restored from the checkpoint (model and optimizer): (full weights, experts' moments)."""
    engine = policy_engine(path, layout_dims())
    load_engine(engine, ckpt)
    return {k: v.clone() for k, v in engine.iter_full_params()}, _moments(engine)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(cases, one process's result, tp 2's result, checkpoint read back by one process)."""
    cases = {}
    for family in MOE_FAMILIES:
        path = write_tiny_moe(family, str(tmp_path_factory.mktemp(f"etp_{family}")), **EXACT_SHAPE)
        cases[family] = (path, margin_checked_batch(path, family) if family == "qwen3_moe" else None)
    odd = write_tiny_moe("qwen2_moe", str(tmp_path_factory.mktemp("etp_odd")), **EXACT_SHAPE, **ODD)
    cases["odd"] = (odd, margin_checked_batch(odd, "qwen2_moe"))
    ckpt = os.path.join(str(tmp_path_factory.mktemp("etp_ckpt")), "actor")
    reference = run_distributed(_run, 1, cases, 1, None)[0]
    got = run_distributed(_run, 2, cases, 2, ckpt)[0]
    read = run_distributed(_read_back, 1, cases["qwen3_moe"][0], ckpt)[0]
    return cases, reference, got, read


def test_tp2_splits_the_routed_experts_of_every_moe_family(launched):
    _, _, (_, _, plans, *_, refusal), _ = launched
    for family in MOE_FAMILIES:
        moe_layers = {n.split(".")[0] for n in plans[family] if ".experts." in n}  # glm4_moe's first is dense
        placements = {n: p for n, p in plans[family].items() if n.split(".")[0] in moe_layers}
        experts = [n for n in placements if ".experts." in n]
        assert len(experts) == 2 * (1 if family == "glm4_moe" else 2), (family, experts)  # glm4_moe: 1 dense layer
        for name, placement in placements.items():
            part = name.split(".mlp.")[1]
            want = next((p for suffix, p in SPLIT.items() if part.endswith(suffix) and
                         (part.startswith("experts.") or part.startswith("shared_expert"))), Replicate())
            assert placement == (want,), (family, name, placement)
        assert any(".gate." in n for n in placements), family  # the router: replicated
    odd = plans["odd"]
    assert all(odd[n] == (Replicate(),) for n in odd if ".experts." in n), odd
    assert odd["1.mlp.shared_expert.down_proj.weight"] == (Shard(1),)
    assert "tensor_model_parallel_size=2 can split" in refusal and "multiples of 8" in refusal, refusal


def test_an_expert_width_tp_does_not_split_keeps_the_replicated_block_exact(launched):
    cases, (ref_odd, _), (odd, *_), _ = launched
    path, batch = cases["odd"]
    metrics, grads, params, counts_LE = odd
    assert torch.equal(counts_LE, 2 * ref_odd[3])  # both tp ranks route every token
    _assert_same_step_and_load((metrics, grads, params, counts_LE / 2), ref_odd, path, batch)


def test_a_tp_rank_holds_half_the_routed_experts(launched):
    _, (_, (total_1, experts_1)), (_, (total_2, experts_2), *_), _ = launched
    print(f"qwen3_moe decoder-layer parameter bytes per rank: tp 1 {total_1} (routed experts {experts_1}), "
          f"tp 2 {total_2} (routed experts {experts_2})")
    assert experts_1 > 0 and 2 * experts_2 == experts_1
    assert total_2 < total_1 - experts_1 // 2 + 1


def test_the_split_state_checkpoints_to_the_full_weights(launched):
    _, _, (_, _, _, (params, moments), restored, _), one_rank = launched
    assert len(moments) == 2 * 2 and all(m.abs().sum() > 0 for m in moments.values())  # 2 layers x 2 moments
    for read, read_moments in (one_rank, restored):  # read by one rank, and by tp 2 again
        assert params.keys() == read.keys() and any("gate_up_proj" in k for k in read)
        assert all(torch.equal(read[k], params[k]) for k in params)
        assert moments.keys() == read_moments.keys()
        assert all(torch.equal(read_moments[k], moments[k]) for k in moments)
