"""Tensor parallelism is exact for multi-latent attention: deepseek_v3 and deepseek_v2 at tp 2 and tp 2 x Ulysses 2.

The tiny models of tests/tiny_deepseek.py (6 heads, q/k head dim 10 = 6 nope + 4 rope, v head dim 6, kv_lora_rank
10, a dense first layer then two routed-MoE layers with a shared expert): deepseek_v3 with its q latent
(q_lora_rank=12) and grouped top-k routing with a nonzero correction bias; deepseek_v2 without a q latent
(q_lora_rank=None: q_proj reads the block input directly), with attention biases (kv_a_proj_with_mqa's and o_proj's)
and its greedy router. Through the FSDP2 policy engine at tp 2 with and without sequence-parallel activations, and
at tp 2 x Ulysses 2 on 4 ranks (a tp rank's 3 heads split 2+1 by Ulysses), the loss metrics, every parameter's
full gradient (the head-split q_b_proj / q_proj, kv_b_proj, o_proj; the replicated latent projections and norms,
whose gradients are summed over tp; routers, routed and shared experts) and the AdamW step equal one process's
within tests/tolerances.py's bounds for the model, and the expert load is tp times one process's, count by count.
One launch per layout runs both models. The layer plan (rlsp.parallel.tp_latent) is checked per parameter, and a
tp that does not divide an attention block's heads is refused by name.

Conditioning: a token near a routing tie could take other experts under another summation order; the fixture
measures the distance of every routing decision of the reference forward from a tie (`deepseek_route_margin`) and
asserts it exceeds the roundoff bound, so a failure says which it is. deepseek_v3 at tp 2 also with R2 routing replay.
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import TOKENS, _assert_same_step, _rollout_batch, policy_engine
from test_moe_exact import _assert_same_step_and_load, step_and_count
from test_tp_moe_exact import replay_step
from tiny_deepseek import deepseek_config, write_tiny_deepseek
from tolerances import model_rtol

from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm

pytestmark = pytest.mark.distributed

# family -> (tiny_deepseek variant, config overrides)
CASES = {"deepseek_v3": ("v3", {}), "deepseek_v2": ("v2", dict(q_lora_rank=None, attention_bias=True))}
HEAD_SPLIT = {"q_b_proj.weight": 0, "q_proj.weight": 0, "kv_b_proj.weight": 0, "o_proj.weight": 1}


def deepseek_route_margin(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[float, float]:
    """(smallest distance of a routing decision from a tie, largest |router logit|) over the real tokens of every
    MoE layer of transformers' forward. deepseek_v3 keeps the topk_group groups of largest summed two best
    sigmoid(logit) + bias, then the top k experts of those groups; a logit moved by d moves a choice score by at
    most d/4 and a group score by d/2, so these gaps are no larger than the logit change that flips them.
    deepseek_v2 (greedy) takes the top k of a softmax: the gap between the k-th and (k+1)-th logit."""
    config, logits = model.config, []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [g.register_forward_hook(lambda m, a, out: logits.append((m, out[0]))) for g in gates]
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask)
    for hook in hooks:
        hook.remove()
    real, k, gaps, scale = attention_mask.reshape(-1).bool(), config.num_experts_per_tok, [], 0.0
    for gate, logits_NE in logits:
        logits_NE = logits_NE.float()[real]
        scale = max(scale, float(logits_NE.abs().max()))
        if config.model_type == "deepseek_v2":
            top_NK = logits_NE.topk(k + 1, dim=-1).values
            gaps.append(float((top_NK[:, k - 1] - top_NK[:, k]).min()))
            continue
        choice_NE = logits_NE.sigmoid() + gate.e_score_correction_bias
        groups, kept = config.n_group, config.topk_group
        group_NG = choice_NE.view(len(choice_NE), groups, -1).topk(2, dim=-1).values.sum(-1)
        ranked_NG = group_NG.topk(groups, dim=-1)
        gaps.append(float((ranked_NG.values[:, kept - 1] - ranked_NG.values[:, kept]).min()))
        keep_NG = torch.zeros_like(group_NG).scatter_(1, ranked_NG.indices[:, :kept], 1.0).bool()
        masked_NE = choice_NE.masked_fill(~keep_NG.repeat_interleave(choice_NE.shape[1] // groups, 1), float("-inf"))
        top_NK = masked_NE.topk(k + 1, dim=-1).values
        gaps.append(float((top_NK[:, k - 1] - top_NK[:, k]).min()))
    return min(gaps), scale


def _margin_checked_batch(path: str, family: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _rollout_batch(model.config.vocab_size)
    gap, scale = deepseek_route_margin(model, batch["input_ids"], batch["attention_mask"])
    roundoff = model_rtol(model.config, TOKENS, backward=False) * scale
    assert gap > 10 * roundoff, f"{family}: a routing decision sits {gap:.3g} from a tie (roundoff {roundoff:.3g})"
    return batch


def _plan_placements(path: str, dims) -> dict[str, tuple]:
    """The tp placements the layer plan gives every parameter of the model's decoder layers (before FSDP2)."""
    from rlsp.parallel.tensor_parallel import apply_tensor_parallel

    model = TokenLogprobModel(load_causal_lm(path, dtype=torch.float32))
    apply_tensor_parallel(model, dims.tp_mesh, dims.layout.sequence_parallel)
    return {n: tuple(p.placements) for n, p in model.decoder.layers.named_parameters()}


def _odd_heads_refusal(dims) -> str:
    """LatentAttentionParallel applied by hand to a 3-head MLA block at tp 2: the error it raises."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import AutoModelForCausalLM

    from rlsp.parallel.tp_latent import LatentAttentionParallel

    model = AutoModelForCausalLM.from_config(deepseek_config("v3", num_attention_heads=3, num_key_value_heads=3))
    try:
        parallelize_module(model.model.layers[0].self_attn, dims.tp_mesh, LatentAttentionParallel(Replicate()))
    except ValueError as error:
        return str(error)
    return "no error"


def _train_families(rank: int, world: int, cases: dict, ulysses: int, tp: int, seq_par: bool, micro: int):
    """`step_and_count` of every family in `cases` ({family: (path, batch)}) on one layout: ({family: result},
    {family: plan placements} and the odd-heads refusal under tp, else None)."""
    dims = layout_dims(ulysses=ulysses, tp=tp, sequence_parallel=seq_par)
    out = {family: step_and_count(policy_engine(path, dims), dims, batch, micro)
           for family, (path, batch) in cases.items()}
    plans = {family: _plan_placements(path, dims) for family, (path, _) in cases.items()} if tp > 1 else None
    refusal = _odd_heads_refusal(dims) if tp > 1 else None
    return (out, plans, refusal) if rank == 0 else None


@pytest.fixture(scope="module")
def mla_cases(tmp_path_factory):
    """({family: (path, margin-checked batch)}, one process's step of each)."""
    cases = {}
    for family, (variant, extra) in CASES.items():
        path = write_tiny_deepseek(variant, str(tmp_path_factory.mktemp(f"tp_{family}")), **extra)
        cases[family] = (path, _margin_checked_batch(path, family))
    batch_rows = len(next(iter(cases.values()))[1])
    reference = run_distributed(_train_families, 1, cases, 1, 1, True, batch_rows)[0][0]
    return cases, reference


def _assert_plan(plans: dict) -> None:
    """Head projections split by heads (Shard of their out rows / o_proj's in columns), everything else of the
    attention block (latent projections and norms, o_proj's bias) replicated over tp."""
    from torch.distributed.tensor import Replicate, Shard

    for family, placements in plans.items():
        attn = {n: p for n, p in placements.items() if ".self_attn." in n}
        heads = [n for n in attn if n.split(".self_attn.")[1] in HEAD_SPLIT]
        assert len(heads) == 3 * 3, (family, sorted(attn))  # 3 layers x (q_b_proj or q_proj, kv_b_proj, o_proj)
        for name, placement in attn.items():
            dim = HEAD_SPLIT.get(name.split(".self_attn.")[1])
            assert placement == ((Shard(dim),) if dim is not None else (Replicate(),)), (family, name, placement)
        assert any("kv_a_layernorm" in n for n in attn) and all(len(p) == 1 for p in placements.values())


def _assert_tp_step(got: tuple, reference: dict, cases: dict, tp: int) -> None:
    results, plans, refusal = got
    assert set(results) == set(CASES)
    for family, (metrics, grads, params, counts_LE) in results.items():
        path, batch = cases[family]
        # every tp rank routes (and counts) the same tokens: the world's sum is tp times one process's count
        assert torch.equal(counts_LE, tp * reference[family][3]), (family, counts_LE, reference[family][3])
        _assert_same_step_and_load((metrics, grads, params, counts_LE / tp), reference[family], path, batch)
    _assert_plan(plans)
    assert "tensor_model_parallel_size=2 does not divide the 3 heads of multi-latent attention layer 0" in refusal, \
        refusal


@pytest.mark.parametrize("seq_par,micro", [(True, 3), (False, 8)], ids=["seqpar", "no_seqpar"])
def test_tp2_keeps_deepseek_loss_gradients_step_and_load_exact(mla_cases, seq_par, micro):
    cases, reference = mla_cases
    _assert_tp_step(run_distributed(_train_families, 2, cases, 1, 2, seq_par, micro)[0], reference, cases, 2)


def test_tp2_x_ulysses2_keeps_deepseek_exact(mla_cases):
    """4 ranks: Ulysses 2 over tp 2 with sequence-parallel activations (a rank attends 2 or 1 of its tp rank's 3
    heads; q/k and v with their own head dims), the routers on the Ulysses shard's tokens."""
    cases, reference = mla_cases
    _assert_tp_step(run_distributed(_train_families, 4, cases, 2, 2, True, 3)[0], reference, cases, 2)


def test_tp2_router_replay_r2_on_deepseek_v3_equals_one_process(mla_cases):
    """R2 routing replay on MLA + grouped routing at tp 2 (sequence parallel): the recorded routes equal one
    process's, and an update replaying them shifted by one expert (of 8) equals one process's, load included."""
    cases, _ = mla_cases
    path, batch = cases["deepseek_v3"]
    ref_routes, reference, ref_counts_LE = run_distributed(replay_step, 1, path, batch, 1, 8)[0]
    routes, got, counts_LE = run_distributed(replay_step, 2, path, batch, 2, 8)[0]
    assert torch.equal(routes, ref_routes) and torch.equal(counts_LE, 2 * ref_counts_LE)
    _assert_same_step(got, reference, path)

