"""The critic under Ulysses: per-token values and value-loss gradients at sp in {2, 4} (and dp x sp)
equal the one-process sp=1 reference — every token's value, the loss metrics and every parameter's
gradient within the bounds tests/tolerances.py derives for the model (`critic_tolerances`) — including
an uneven head layout (6 q / 2 kv heads at sp=4)."""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import B, P, _rollout_batch, tolerances
from tolerances import assert_grads_close, assert_scalars_close, assert_tensor_close

from rlsp.data.batch import Batch
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.models.loading import load_backbone
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.models.value import ValueModel
from rlsp.workers.critic_loss import make_critic_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed

CLIP = 0.2
SPECS = {
    "4q2kv": TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2),
    "6q2kv": TinyModelSpec(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2),
}


def critic_engine(model_path: str, dims, compute_dtype: torch.dtype = torch.float32) -> FSDPEngine:
    """The critic as the critic role builds it: seeded value head over the model's backbone."""
    backbone = load_backbone(model_path, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = ValueModel(backbone, init_std=0.5)  # a large head makes values (and errors) visible
    return FSDPEngine(module, dims, torch.device("cpu"), compute_dtype=compute_dtype,
                      optim=OptimSettings(lr=1e-3, grad_clip=0.0))


CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")


def critic_tolerances(path: str, ref_values: torch.Tensor) -> tuple[float, float, float]:
    """(value / metric rtol, gradient rtol, scale): the model's `tolerances`, with the values' size as the
    scale of every value and of the loss terms built from them."""
    forward, backward, _ = tolerances(path)
    return forward, backward, float(ref_values.abs().max())


def _with_critic_fields(batch: Batch) -> Batch:
    g = torch.Generator().manual_seed(7)
    mask = batch["response_mask"]
    batch.set("values", torch.randn(mask.shape, generator=g) * 0.3 * mask)
    batch.set("returns", torch.randn(mask.shape, generator=g) * mask)
    return batch


def _values_and_grads(rank: int, world: int, model_path: str, sp: int, batch: Batch, ring: int = 1, tp: int = 1,
                      mode: str = "token-mean", micro: int = 2):
    dims = layout_dims(ulysses=sp, ring=ring, tp=tp)
    engine = critic_engine(model_path, dims)
    values = engine.infer(batch, P, 3, "values")  # every rank gets the whole batch: the sp ranks split it
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    engine.optimizer.zero_grad(set_to_none=True)
    loss_fn = make_critic_loss(CLIP, *global_counts(shard, dims.dp_group), mode)  # the critic role's normalisers
    metrics = engine.backward_batch(shard, P, micro, loss_fn)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    return (values, metrics, grads) if rank == 0 else None


@pytest.fixture(scope="module", params=sorted(SPECS))
def reference(request, tmp_path_factory):
    path = build_tiny_model(SPECS[request.param], str(tmp_path_factory.mktemp(request.param)))
    from transformers import AutoConfig

    batch = _with_critic_fields(_rollout_batch(AutoConfig.from_pretrained(path).vocab_size))
    return path, batch, run_distributed(_values_and_grads, 1, path, 1, batch)[0]


@pytest.mark.parametrize("world,sp,ring,tp", [(2, 2, 1, 1), (4, 4, 1, 1), (4, 2, 1, 1), (2, 1, 2, 1), (4, 2, 2, 1),
                                             (8, 4, 2, 1), (2, 1, 1, 2), (4, 1, 1, 2)])
def test_critic_values_and_grads_match_sp1(reference, world, sp, ring, tp):
    """Ulysses, ring, Ulysses x ring, TP and dp x TP layouts give the unsharded critic's values, loss and
    gradients."""
    path, batch, (ref_values, ref_metrics, ref_grads) = reference
    values, metrics, grads = run_distributed(_values_and_grads, world, path, sp, batch, ring, tp)[0]
    mask = batch["response_mask"].bool()
    assert values.shape == (B, batch["response_mask"].shape[1])
    assert float(ref_values[mask].abs().min()) > 0.0  # real values on every response token
    rtol, grad_rtol, scale = critic_tolerances(path, ref_values)
    assert_tensor_close(values, ref_values, rtol, scale)
    assert_scalars_close(metrics, ref_metrics, CRITIC_METRICS, rtol, scale)
    assert ref_metrics["critic/vf_loss"] > 0 and 0 < ref_metrics["critic/vf_clipfrac"] < 1
    assert "value_head.weight" in grads
    assert_grads_close(grads, ref_grads, grad_rtol)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_critic_sequence_loss_aggregation_is_exact(reference, mode):
    """critic.loss_agg_mode (verl: the actor's unless set) over the whole mini-batch: two micro-batch
    splits on one rank, dp=2 and Ulysses 2 give the same value loss and gradients."""
    path, batch, (ref_values, token_mean_metrics, _) = reference
    _, ref_metrics, ref_grads = run_distributed(_values_and_grads, 1, path, 1, batch, 1, 1, mode, B)[0]
    assert abs(ref_metrics["critic/vf_loss"] - token_mean_metrics["critic/vf_loss"]) > 1e-4
    rtol, grad_rtol, scale = critic_tolerances(path, ref_values)
    for world, sp, micro in ((1, 1, 3), (2, 1, 2), (2, 2, 3)):
        _, metrics, grads = run_distributed(_values_and_grads, world, path, sp, batch, 1, 1, mode, micro)[0]
        assert_scalars_close(metrics, ref_metrics, ("critic/vf_loss",), rtol, scale)
        assert_grads_close(grads, ref_grads, grad_rtol)
