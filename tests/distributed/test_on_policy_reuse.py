"""On-policy updates take the old logprobs from the update's own forward: the step lands on the same
weights with the same losses as recomputing them in a separate pass first (fp32, every parameter),
at dp=2 and at sp=2, and still reports the rollout-vs-trainer logprob gap."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS, LR, METRICS, P, _rollout_batch, policy_engine, tolerances
from tolerances import assert_adam_step_close, assert_scalars_close, scalar_tol

from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.workers.actor_loss import make_actor_loss

pytestmark = pytest.mark.distributed


def _step(rank: int, world: int, path: str, batch, sp: int, recompute: bool):
    dims = layout_dims(ulysses=sp)
    engine = policy_engine(path, dims, lr=1e-3)
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    if recompute:
        shard.set("old_logprobs", engine.infer(shard, P, 5, "logprobs", temperature=1.0))
    else:
        shard.tensors.del_("old_logprobs")
    count = shard["response_mask"].sum().double().reshape(1)
    dist.all_reduce(count, group=dims.dp_group)
    metrics = engine.train_step(shard, P, 3, make_actor_loss(LOSS, float(count)), temperature=1.0, with_entropy=True)
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}  # what the step used (no clipping)
    return (metrics, params, grads) if rank == 0 else None


@pytest.fixture(scope="module")
def model_and_batch(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    path = build_tiny_model(spec, str(tmp_path_factory.mktemp("tiny")))
    from transformers import AutoConfig

    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    batch.set("rollout_logprobs", batch["old_logprobs"])  # any values: only the reported gap uses them
    return path, batch


@pytest.mark.parametrize("world,sp", [(2, 1), (2, 2)])
def test_reusing_the_update_forward_equals_recomputing(model_and_batch, world, sp):
    path, batch = model_and_batch
    m_re, p_re, g_re = run_distributed(_step, world, path, batch, sp, True)[0]
    m_on, p_on, g_on = run_distributed(_step, world, path, batch, sp, False)[0]
    rtol, grad_rtol, scale = tolerances(path)
    assert_scalars_close(m_on, m_re, METRICS, rtol, scale)
    assert_scalars_close(m_on, m_re, ("grad_norm",), grad_rtol)
    # ratio exactly 1 / 1 up to the roundoff of two forwards' logprobs (a logprob difference)
    assert m_on["actor/ppo_kl"] == 0.0 and abs(m_re["actor/ppo_kl"]) <= scalar_tol(scale, rtol)
    assert_adam_step_close(p_on, p_re, g_on, g_re, LR)
    assert m_on["rollout/logprob_diff"] > 0 and m_on["rollout/logprob_diff_max"] >= m_on["rollout/logprob_diff"]
