"""Adaptive sequence parallelism: each micro-batch runs at the smallest Ulysses degree whose token
budget holds it, the group's other ranks taking other micro-batches. Loss, gradients, the AdamW step
and inferred logprobs (the actor) and values, value loss and gradients (the critic) must equal one
rank's exactly, whatever mix of degrees the rows get.

The batch (test_fsdp_engine's rollout rows, 2..13 tokens) under a budget of 5 tokens per rank: rows
of <= 5 tokens run at degree 1, <= 10 at degree 2, longer ones at 4 (or at the group's full degree).
"""

from __future__ import annotations

import pytest
import test_fsdp_engine
import torch
import torch.distributed as dist
from _launch import layout_dims, run_distributed
from test_critic_exact import CLIP, CRITIC_METRICS, _with_critic_fields, critic_engine, critic_tolerances
from test_fsdp_engine import LOSS, P, _assert_same_step, policy_engine, tolerances
from tolerances import assert_grads_close, assert_scalars_close, assert_tensor_close, scalar_tol

from rlsp.engine.micro import plan_micro_batches
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.critic_loss import make_critic_loss

pytestmark = pytest.mark.distributed
BUDGET = 5
model_and_batch = test_fsdp_engine.model_and_batch  # the tiny model, its batch and the one-rank reference step


def _adaptive_step(rank: int, world: int, model_path: str, ulysses: int, batch, budget: int):
    dims = layout_dims(ulysses=ulysses, adaptive=True)
    engine = policy_engine(model_path, dims)
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    degrees = sorted({p.degree for p in plan_micro_batches(shard, 1, budget, dims)})
    logprobs = engine.infer(shard, P, 1, "logprobs", budget, temperature=1.0)
    count = shard["response_mask"].sum().double().reshape(1)
    dist.all_reduce(count, group=dims.dp_group)
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(shard, P, 1, make_actor_loss(LOSS, float(count)), budget, temperature=1.0,
                                    with_entropy=True)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    engine.optimizer.step()
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    check = engine.sp_self_check(shard, P, "logprobs", temperature=1.0)
    return (metrics, grads, params, logprobs, degrees, check) if dims.coords.ulysses == 0 else None


def _plain_logprobs(rank: int, world: int, model_path: str, batch):
    return policy_engine(model_path, layout_dims()).infer(batch, P, len(batch), "logprobs", temperature=1.0)


@pytest.mark.parametrize("world,ulysses,degrees", [(2, 2, [1, 2]), (4, 4, [1, 2, 4]), (4, 2, [1, 2])])
def test_adaptive_degrees_keep_loss_gradients_step_and_logprobs_exact(model_and_batch, world, ulysses, degrees):
    path, batch, (ref_metrics, ref_grads, ref_params) = model_and_batch
    ref_lp = run_distributed(_plain_logprobs, 1, path, batch)[0]
    results = [r for r in run_distributed(_adaptive_step, world, path, ulysses, batch, BUDGET) if r is not None]
    metrics, grads, params, _, used, check = results[0]
    assert used == degrees  # the rows really ran at several degrees
    rtol, _, scale = tolerances(path)
    assert check <= scalar_tol(scale, rtol)  # the self-check (a logprob difference) covers every degree
    _assert_same_step((metrics, grads, params), (ref_metrics, ref_grads, ref_params), path)
    shards = torch.cat([r[3] for r in results])  # dp shards in rank order
    assert_tensor_close(shards, ref_lp, rtol)


def _critic_adaptive(rank: int, world: int, model_path: str, batch, adaptive: bool):
    dims = layout_dims(ulysses=world, adaptive=adaptive) if adaptive else layout_dims()
    engine = critic_engine(model_path, dims)
    values = engine.infer(batch, P, 1, "values", BUDGET)
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(batch, P, 1, make_critic_loss(CLIP, float(batch["response_mask"].sum())), BUDGET)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    return (values, metrics, grads) if rank == 0 else None


def test_adaptive_critic_matches_one_rank(model_and_batch):
    path, batch, _ = model_and_batch
    batch = _with_critic_fields(batch)
    ref_values, ref_metrics, ref_grads = run_distributed(_critic_adaptive, 1, path, batch, False)[0]
    values, metrics, grads = run_distributed(_critic_adaptive, 2, path, batch, True)[0]
    assert float(ref_values.abs().max()) > 0
    rtol, grad_rtol, scale = critic_tolerances(path, ref_values)
    assert_tensor_close(values, ref_values, rtol, scale)
    assert_scalars_close(metrics, ref_metrics, CRITIC_METRICS, rtol, scale)
    assert_grads_close(grads, ref_grads, grad_rtol)
