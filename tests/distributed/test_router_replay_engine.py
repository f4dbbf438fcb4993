"""MoE routing replay R2 through the FSDP2 policy engine on a tiny qwen3_moe (tests/tiny_moe.py `write_exact_moe`).

One process: `infer_many(record_routes=True)` returns the routes of every real token as row columns; a training pass
that replays them from the same weights gives bit for bit the gradients and metrics of the free pass (the rows -> stream
-> rows path puts each token's routes back under it). After the router weights move, a free old-logprob pass picks
other experts while the replayed update's routers use the recorded ones (expert load counts them).
Ulysses 2 with R2: the recorded routes equal one process's exactly, and the replayed update's loss metrics, every
full gradient and the AdamW step equal one process's within tests/tolerances.py's bounds.
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS, LR, P, _assert_same_step, _rollout_batch
from tiny_moe import write_exact_moe

from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.engine.router_replay import ROUTES_KEY
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed

MICRO = 3


def _engine(path: str, sp: int) -> FSDPEngine:
    lm = load_causal_lm(path, dtype=torch.float32)
    return FSDPEngine(TokenLogprobModel(lm), layout_dims(ulysses=sp), torch.device("cpu"),
                      optim=OptimSettings(lr=LR, grad_clip=0.0), router_replay=True)


def _step(engine: FSDPEngine, batch) -> tuple:
    engine.optimizer.zero_grad(set_to_none=True)
    loss_fn = make_actor_loss(LOSS, *global_counts(batch, engine.dims.dp_group))
    metrics = engine.backward_batch(batch, P, MICRO, loss_fn, temperature=1.0, with_entropy=True)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    return metrics, grads


def _record(engine: FSDPEngine, batch) -> torch.Tensor:
    return engine.infer_many(batch, P, MICRO, ("logprobs",), record_routes=True, temperature=1.0)[ROUTES_KEY]


def _same_weights(rank: int, world: int, path: str, batch):
    engine = _engine(path, 1)
    routes = _record(engine, batch)
    free = _step(engine, batch)
    replayed = _step(engine, _with(batch, routes))
    return routes, free, replayed


def _with(batch, routes):
    out = batch.select_rows(list(range(len(batch))))
    out.set(ROUTES_KEY, routes)
    return out


def _moved_router(rank: int, world: int, path: str, batch):
    engine = _engine(path, 1)
    routes = _record(engine, batch)
    with torch.no_grad():
        for router in engine.router_replay.routers:
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(2)))
    free_routes = _record(engine, batch)
    engine.expert_load.reset()
    _step(engine, _with(batch, routes))
    replayed_counts = engine.expert_load.counts_LE.clone()
    engine.expert_load.reset()
    _step(engine, batch)
    return routes, free_routes, replayed_counts, engine.expert_load.counts_LE.clone()


def _sp_step(rank: int, world: int, path: str, batch, sp: int):
    engine = _engine(path, sp)
    routes = _record(engine, batch)
    metrics, grads = _step(engine, _with(batch, routes))
    engine.optimizer.step()
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    return (routes, (metrics, grads, params)) if rank == 0 else None


@pytest.fixture(scope="module")
def moe_and_batch(tmp_path_factory):
    from transformers import AutoConfig

    path = write_exact_moe("qwen3_moe", str(tmp_path_factory.mktemp("r2_engine") / "qwen3_moe"))
    return path, _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)


def _counts(routes_BLLK: torch.Tensor, batch, layers: int, experts: int) -> torch.Tensor:
    """Tokens per expert per layer of the real tokens' recorded routes."""
    real = batch["attention_mask"].bool()
    picked = routes_BLLK[real].long()  # [N, L, K]
    return torch.stack([torch.bincount(picked[:, layer].reshape(-1), minlength=experts) for layer in range(layers)]).double()


def test_replay_from_same_weights_is_exact_and_moved_router_keeps_routes(moe_and_batch):
    path, batch = moe_and_batch
    routes, (free_metrics, free_grads), (metrics, grads) = run_distributed(_same_weights, 1, path, batch)[0]
    assert routes.shape == (len(batch), batch["input_ids"].shape[1], 2, 2) and routes.dtype == torch.int16
    assert (routes[~batch["attention_mask"].bool()] == 0).all()
    assert {k: v for k, v in metrics.items() if "time" not in k} == {k: v for k, v in free_metrics.items()
                                                                      if "time" not in k}
    for name, grad in grads.items():
        assert torch.equal(grad, free_grads[name]), name
    routes, free_routes, replayed_counts, free_counts = run_distributed(_moved_router, 1, path, batch)[0]
    assert not torch.equal(free_routes, routes)  # the moved routers choose other experts
    assert torch.equal(replayed_counts, _counts(routes, batch, 2, 4))  # the update routed by the recorded ones
    assert torch.equal(free_counts, _counts(free_routes, batch, 2, 4))


def test_ulysses_2_with_replay_equals_one_process(moe_and_batch):
    path, batch = moe_and_batch
    ref_routes, reference = run_distributed(_sp_step, 1, path, batch, 1)[0]
    routes, got = run_distributed(_sp_step, 2, path, batch, 2)[0]
    assert torch.equal(routes, ref_routes)
    _assert_same_step(got, reference, path)
