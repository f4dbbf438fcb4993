"""Importance weights in the actor loss (algorithm.rollout_correction.rollout_is): each token's clipped
surrogate is multiplied by its weight and rejected tokens (mask 0) leave the loss and its token count.

Reference: the loss computed by hand from the policy's own logprobs on one rank (fp32); the same batch
at dp=2 and at Ulysses sp=2 must give the same loss and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _launch import layout_dims, run_distributed
from test_fsdp_engine import P, _rollout_batch, policy_engine, tolerances
from tolerances import assert_grads_close, assert_scalars_close

from rlsp.algos.policy_loss import compute_ppo_clip_loss
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.workers.actor_loss import ActorLossConfig, make_actor_loss

pytestmark = pytest.mark.distributed
LOSS = ActorLossConfig(use_kl_loss=False, entropy_coeff=0.0)


def _step(rank: int, world: int, path: str, batch, sp: int):
    dims = layout_dims(ulysses=sp)
    engine = policy_engine(path, dims)
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    logprobs = engine.infer(shard, P, 8, "logprobs", temperature=1.0)
    count = shard["response_mask"].sum().double().reshape(1)
    dist.all_reduce(count, group=dims.dp_group)
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(shard, P, 3, make_actor_loss(LOSS, float(count)), None, temperature=1.0,
                                    with_entropy=True)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    return (metrics, grads, logprobs) if rank == 0 else None


@pytest.fixture(scope="module")
def model_and_batch(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    path = build_tiny_model(spec, str(tmp_path_factory.mktemp("tiny")))
    from transformers import AutoConfig

    batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
    g = torch.Generator().manual_seed(3)
    mask = batch["response_mask"]
    batch.set("rollout_is_weights", (torch.rand(mask.shape, generator=g) * 2.0) * mask)
    rejected = (torch.rand(mask.shape, generator=g) < 0.2).float()
    batch.set("response_mask", mask * (1.0 - rejected))
    return path, batch


def test_weighted_loss_matches_hand_computation_and_is_layout_independent(model_and_batch):
    path, batch = model_and_batch
    m1, g1, logprobs = run_distributed(_step, 1, path, batch, 1)[0]
    mask = batch["response_mask"]
    tokens, _ = compute_ppo_clip_loss(logprobs.double(), batch["old_logprobs"].double(), batch["advantages"].double(),
                                      mask.double())
    expected = float((tokens * batch["rollout_is_weights"].double() * mask).sum() / mask.sum())
    rtol, grad_rtol, scale = tolerances(path)  # the update's forward runs other micro-batches than infer's
    assert_scalars_close(m1, {"actor/pg_loss": expected}, ("actor/pg_loss",), rtol, scale)
    for world, sp in ((2, 1), (2, 2)):
        m, g, _ = run_distributed(_step, world, path, batch, sp)[0]
        assert_scalars_close(m, m1, ("actor/pg_loss",), rtol, scale)
        assert_grads_close(g, g1, grad_rtol)
