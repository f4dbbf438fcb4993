"""Tensor parallelism is exact for the MoE families: qwen2_moe, qwen3_moe, mixtral, olmoe, glm4_moe at tp 2.

The tiny models of tests/distributed/test_moe_exact.py (tests/tiny_moe.py `write_exact_moe`: 2 layers, 4 experts,
2 per token, 6 q / 2 kv heads, so a tp rank holds 3 q / 1 kv heads; qwen2_moe with a gated shared expert, glm4_moe
with a shared expert, a dense first layer, sigmoid routing, attention biases, partial rotary and per-head q/k norms
(use_qk_norm); qwen3_moe with per-head q/k norms; olmoe with q/k norms over the whole projection) go through the
FSDP2 policy engine at tp 2 with and without sequence-parallel activations, and at tp 2 x Ulysses 2 on 4 ranks: the
loss metrics, every parameter's full gradient (routers, routed experts, the shared experts split over tp like an
MLP, norms) and the AdamW step equal one process's within tests/tolerances.py's bounds for the model, and the
expert load the engine counts is tp times one process's, count by count (every tp rank routes the same tokens), so
its metrics are the same. One launch per layout runs every family (the processes start once). qwen3_moe at tp 2
also with routing replay R2 (the recorded routes equal one process's; an update replaying other routes equals one
process's) and with the router auxiliary loss (with and without sequence-parallel activations).
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS, LR, METRICS, P, _assert_same_step, policy_engine
from test_moe_exact import _assert_same_step_and_load, margin_checked_batch, step_and_count
from tiny_moe import EXACT_SHAPE, MOE_FAMILIES, write_tiny_moe

from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.engine.router_replay import ROUTES_KEY
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed

AUX_COEF = 0.5  # the router auxiliary loss's coefficient (large, so a wrong share of it shows)
# glm4_moe with its optional attention extras on (transformers' defaults leave them off)
EXTRAS = {"glm4_moe": dict(use_qk_norm=True, attention_bias=True)}


def _train_families(rank: int, world: int, cases: dict, ulysses: int, tp: int, seq_par: bool, micro: int):
    """`step_and_count` of every family in `cases` ({family: (path, batch)}) on one layout: {family: result}."""
    dims = layout_dims(ulysses=ulysses, tp=tp, sequence_parallel=seq_par)
    out = {family: step_and_count(policy_engine(path, dims), dims, batch, micro)
           for family, (path, batch) in cases.items()}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def moe_cases(tmp_path_factory):
    """({family: (path, margin-checked batch)}, one process's step of each)."""
    cases = {}
    for family in MOE_FAMILIES:
        path = write_tiny_moe(family, str(tmp_path_factory.mktemp(f"tp_{family}")), **EXACT_SHAPE,
                              **EXTRAS.get(family, {}))
        cases[family] = (path, margin_checked_batch(path, family))
    reference = run_distributed(_train_families, 1, cases, 1, 1, True, len(next(iter(cases.values()))[1]))[0]
    return cases, reference


def _assert_tp_step(got: dict, reference: dict, cases: dict, tp: int) -> None:
    for family, result in got.items():
        path, batch = cases[family]
        metrics, grads, params, counts_LE = result
        # every tp rank routes (and counts) the same tokens: the world's sum is tp times one process's count
        assert torch.equal(counts_LE, tp * reference[family][3]), (family, counts_LE, reference[family][3])
        _assert_same_step_and_load((metrics, grads, params, counts_LE / tp), reference[family], path, batch)


@pytest.mark.parametrize("seq_par,micro", [(True, 3), (False, 8)], ids=["seqpar", "no_seqpar"])
def test_tp2_keeps_moe_families_loss_gradients_step_and_load_exact(moe_cases, seq_par, micro):
    cases, reference = moe_cases
    got = run_distributed(_train_families, 2, cases, 1, 2, seq_par, micro)[0]
    assert set(got) == set(MOE_FAMILIES)
    _assert_tp_step(got, reference, cases, 2)


def test_tp2_x_ulysses2_keeps_moe_families_exact(moe_cases):
    """4 ranks: Ulysses 2 over tp 2 with sequence-parallel activations (a rank attends 2 or 1 of its tp rank's 3 q
    heads, its kv head replicated), the router of every layer on the Ulysses shard's tokens."""
    cases, reference = moe_cases
    got = run_distributed(_train_families, 4, cases, 2, 2, True, 3)[0]
    assert set(got) == set(MOE_FAMILIES)
    _assert_tp_step(got, reference, cases, 2)


def replay_step(rank: int, world: int, path: str, batch, tp: int, experts: int = 4):
    """R2 at tp `tp` (sequence parallel): record the routes of an old-logprob pass, then update replaying other
    routes (every expert index shifted by one of `experts`, so the replay visibly overrides the routers): (recorded routes,
    (metrics, full grads, params after the step), expert load of the update)."""
    dims = layout_dims(tp=tp)
    engine = FSDPEngine(TokenLogprobModel(load_causal_lm(path, dtype=torch.float32)), dims, torch.device("cpu"),
                        optim=OptimSettings(lr=LR, grad_clip=0.0), router_replay=True)
    routes = engine.infer_many(batch, P, 3, ("logprobs",), record_routes=True, temperature=1.0)[ROUTES_KEY]
    replayed = batch.select_rows(list(range(len(batch))))
    replayed.set(ROUTES_KEY, ((routes.long() + 1) % experts).to(routes.dtype))
    engine.expert_load.reset()
    engine.optimizer.zero_grad(set_to_none=True)
    loss_fn = make_actor_loss(LOSS, *global_counts(replayed, dims.dp_group))
    metrics = engine.backward_batch(replayed, P, 3, loss_fn, temperature=1.0, with_entropy=True)
    counts_LE = engine.expert_load.counts_LE.clone()
    torch.distributed.all_reduce(counts_LE)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    engine.optimizer.step()
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    return (routes, (metrics, grads, params), counts_LE) if rank == 0 else None


def test_tp2_router_replay_r2_equals_one_process(moe_cases):
    """Routing replay under tp: the routes recorded at tp 2 equal one process's, and an update replaying shifted
    routes equals one process's replaying them (every tp rank's routers take the routes of the same tokens)."""
    cases, _ = moe_cases
    path, batch = cases["qwen3_moe"]
    ref_routes, reference, ref_counts_LE = run_distributed(replay_step, 1, path, batch, 1)[0]
    routes, got, counts_LE = run_distributed(replay_step, 2, path, batch, 2)[0]
    assert torch.equal(routes, ref_routes)
    real = batch["attention_mask"].bool()
    shifted_NLK = (ref_routes[real].long() + 1) % 4
    replayed_LE = torch.stack([torch.bincount(shifted_NLK[:, layer].reshape(-1), minlength=4) for layer in range(2)])
    assert torch.equal(ref_counts_LE, replayed_LE.double()) and torch.equal(counts_LE, 2 * ref_counts_LE)
    _assert_same_step(got, reference, path)


def _aux_steps(rank: int, world: int, path: str, batch, tp: int):
    """The actor loss plus the router auxiliary loss (coefficient AUX_COEF) at tp `tp`, with and without
    sequence-parallel activations (tp 1: once), micro-batches of 3 rows: [(metrics, grads, params)]."""
    out = []
    for seq_par in (True, False) if tp > 1 else (True,):
        dims = layout_dims(tp=tp, sequence_parallel=seq_par)
        engine = FSDPEngine(TokenLogprobModel(load_causal_lm(path, dtype=torch.float32)), dims, torch.device("cpu"),
                            optim=OptimSettings(lr=LR, grad_clip=0.0), router_aux_coef=AUX_COEF)
        engine.optimizer.zero_grad(set_to_none=True)
        loss_fn = make_actor_loss(LOSS, *global_counts(batch, dims.dp_group))
        metrics = engine.backward_batch(batch, P, 3, loss_fn, temperature=1.0, with_entropy=True)
        grads = {k: v.clone() for k, v in engine.iter_full_grads()}
        engine.optimizer.step()
        out.append((metrics, grads, {k: v.clone() for k, v in engine.iter_full_params()}))
    return out if rank == 0 else None


def test_tp2_keeps_the_router_aux_loss_exact(moe_cases):
    """qwen3_moe with the router auxiliary loss at tp 2, with and without sequence-parallel activations: the loss
    metrics, the auxiliary loss metric, every gradient and the AdamW step of one process (same micro-batches)."""
    from rlsp.engine.router_aux import METRIC

    cases, _ = moe_cases
    path, batch = cases["qwen3_moe"]
    reference = run_distributed(_aux_steps, 1, path, batch, 1)[0][0]
    assert reference[0][METRIC] > 0
    for got in run_distributed(_aux_steps, 2, path, batch, 2)[0]:
        _assert_same_step(got, reference, path, keys=(*METRICS, METRIC))
