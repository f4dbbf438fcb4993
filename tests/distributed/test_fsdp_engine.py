"""FSDP2 engine: the actor loss and its gradients are exact whatever the dp x sp layout and micro-batching.

Reference: one process (world=1, sp=1, one micro-batch). Every other layout must reproduce the loss
metrics and every parameter's full gradient (after FSDP's reduction) to fp32 precision, and an AdamW
step must land on the same parameters; the bounds are derived in tests/tolerances.py from the tiny
model's sizes (`tolerances` below).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _launch import layout_dims, run_distributed
from tolerances import assert_adam_step_close, assert_grads_close, assert_scalars_close, model_rtol

from rlsp.data.batch import Batch
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.workers.actor_loss import ActorLossConfig, make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed

P, R, B = 6, 7, 8
TOKENS = B * (P + R)  # a batch's tokens, padding included: the longest token reduction (an upper bound)
LR = 1e-3  # policy_engine's default learning rate
METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy")
LOSS = ActorLossConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coeff=0.01)


def _rollout_batch(vocab: int, seed: int = 0, empty_tail: bool = False) -> Batch:
    """Left-padded prompts and right-padded responses of ragged lengths, with training fields.

    empty_tail: the last half of the rows has no response token (a dp shard without any loss token).
    """
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (B, P + R), generator=g)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for b in range(B):
        p_len = 1 + b % P
        r_len = 0 if (empty_tail and b >= B // 2) else 1 + (3 * b) % R
        mask[b, P - p_len : P + r_len] = 1
    input_ids = input_ids * mask
    resp_mask = mask[:, P:].float()
    fields = {name: (torch.randn(B, R, generator=g) * scale - shift) * resp_mask
              for name, scale, shift in (("old_logprobs", 0.3, 3.0), ("ref_logprobs", 0.3, 3.0), ("advantages", 1.0, 0.0))}
    return Batch.from_dict({"input_ids": input_ids, "attention_mask": mask, "response_mask": resp_mask, **fields})


def policy_engine(model_path: str, dims, *, trainable: bool = True, lr: float = 1e-3,
                  compute_dtype: torch.dtype = torch.float32) -> FSDPEngine:
    """The policy engine as the actor role builds it: fp32 master weights, compute in `compute_dtype`."""
    lm = load_causal_lm(model_path, dtype=torch.float32 if trainable else compute_dtype)
    optim = OptimSettings(lr=lr, grad_clip=0.0) if trainable else None
    return FSDPEngine(TokenLogprobModel(lm), dims, torch.device("cpu"), compute_dtype=compute_dtype, optim=optim)


def _train_once(rank: int, world: int, model_path: str, sp: int, micro: int, batch: Batch,
                max_tokens: int | None = None, fsdp_size: int = -1, ring: int = 1, tp: int = 1,
                sequence_parallel: bool = True, loss: ActorLossConfig = LOSS):
    dims = layout_dims(ulysses=sp, ring=ring, tp=tp, fsdp_size=fsdp_size, sequence_parallel=sequence_parallel)
    engine = policy_engine(model_path, dims)
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    loss_fn = make_actor_loss(loss, *global_counts(shard, dims.dp_group))  # the actor role's normalisers
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(shard, P, micro, loss_fn, max_tokens, temperature=1.0, with_entropy=True)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    engine.optimizer.step()
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    return (metrics, grads, params) if rank == 0 else None


@pytest.fixture(scope="module")
def model_and_batch(tmp_path_factory):
    path = build_tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2), str(tmp_path_factory.mktemp("tiny")))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    batch = _rollout_batch(vocab)
    reference = run_distributed(_train_once, 1, path, 1, B, batch)[0]
    return path, batch, reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tolerances(path: str, tokens: int = TOKENS) -> tuple[float, float, float]:
    """(metric rtol, gradient rtol, metric scale) of two computations of one update of the model at `path`
    over `tokens` tokens: `model_rtol` of its forward (metrics) and forward + backward (gradients); a loss
    metric is a weighted mean of terms of a logprob's size, log(vocab), whose roundoff it carries."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return (model_rtol(config, tokens, backward=False), model_rtol(config, tokens), math.log(config.vocab_size))


def _assert_same_step(got: tuple, ref: tuple, path: str, keys: tuple[str, ...] = METRICS, step: bool = True) -> None:
    """Loss metrics, every full gradient and the AdamW step (`step`) equal the reference's within the bounds
    tests/tolerances.py derives for the model at `path`."""
    (metrics, grads, params), (ref_metrics, ref_grads, ref_params) = got, ref
    metric_rtol, grad_rtol, scale = tolerances(path)
    assert_scalars_close(metrics, ref_metrics, keys, metric_rtol, scale)
    assert_grads_close(grads, ref_grads, grad_rtol)
    if step:
        assert_adam_step_close(params, ref_params, grads, ref_grads, LR)


@pytest.mark.parametrize("world,sp,micro", [(2, 1, 2), (2, 2, 3), (2, 2, B), (4, 2, 1), (4, 4, 3)])
def test_layout_and_micro_batching_do_not_change_loss_or_gradients(model_and_batch, world, sp, micro):
    path, batch, (ref_metrics, ref_grads, ref_params) = model_and_batch
    metrics, grads, params = run_distributed(_train_once, world, path, sp, micro, batch)[0]
    _assert_same_step((metrics, grads, params), (ref_metrics, ref_grads, ref_params), path)


@pytest.mark.parametrize("world,ulysses,ring,micro,max_tokens", [
    (2, 1, 2, 3, None), (4, 1, 4, 2, None), (4, 2, 2, 3, None), (4, 2, 2, B, 24), (8, 2, 2, 2, None)])
def test_ring_and_ulysses_x_ring_keep_loss_gradients_and_step_exact(model_and_batch, world, ulysses, ring, micro,
                                                                     max_tokens):
    """Sequences split over ulysses x ring ranks (zigzag across the ring), dp groups beside them,
    fixed-size or token-budget micro-batches: the same loss, gradients and AdamW step as one rank."""
    path, batch, (ref_metrics, ref_grads, ref_params) = model_and_batch
    metrics, grads, params = run_distributed(_train_once, world, path, ulysses, micro, batch, max_tokens, -1, ring)[0]
    _assert_same_step((metrics, grads, params), (ref_metrics, ref_grads, ref_params), path)


@pytest.mark.parametrize("world,ulysses,ring,tp,seq_par,micro", [
    (2, 1, 1, 2, True, 3), (2, 1, 1, 2, False, 3), (4, 1, 1, 2, True, 2), (4, 2, 1, 2, True, 3),
    (4, 1, 2, 2, True, 3)])
def test_tensor_parallel_layouts_keep_loss_gradients_and_step_exact(model_and_batch, world, ulysses, ring, tp,
                                                                    seq_par, micro):
    """TP 2 with and without sequence-parallel activations, dp x tp (FSDP2 over dp, TP inside), and TP
    composed with Ulysses or ring: the same loss metrics, gradients and AdamW step as one rank."""
    path, batch, (ref_metrics, ref_grads, ref_params) = model_and_batch
    metrics, grads, params = run_distributed(_train_once, world, path, ulysses, micro, batch, None, -1, ring, tp,
                                             seq_par)[0]
    _assert_same_step((metrics, grads, params), (ref_metrics, ref_grads, ref_params), path)


@pytest.mark.parametrize("world,sp,fsdp_size", [(2, 1, 1), (2, 2, 1), (4, 2, 2), (4, 1, 1), (4, 4, 2)])
def test_hybrid_sharding_keeps_loss_gradients_and_step_exact(model_and_batch, world, sp, fsdp_size):
    """fsdp_size < world (HSDP: shard within groups, replicate across; 1 = DDP-like) changes nothing."""
    path, batch, (ref_metrics, ref_grads, ref_params) = model_and_batch
    metrics, grads, params = run_distributed(_train_once, world, path, sp, 2, batch, None, fsdp_size)[0]
    _assert_same_step((metrics, grads, params), (ref_metrics, ref_grads, ref_params), path)


def test_rank_without_response_tokens_still_exact(model_and_batch):
    """dp rank 1 gets only prompt rows (no loss token); it must still join every collective."""
    path, batch, _ = model_and_batch
    vocab = int(batch["input_ids"].max()) + 1
    empty = _rollout_batch(vocab, seed=3, empty_tail=True)
    ref = run_distributed(_train_once, 1, path, 1, B, empty)[0]
    for world, sp, micro in ((2, 1, 2), (2, 2, 1)):
        got = run_distributed(_train_once, world, path, sp, micro, empty)[0]
        _assert_same_step(got, ref, path, step=False)


@pytest.mark.parametrize("world,sp,max_tokens", [(1, 1, 16), (2, 1, 10), (2, 2, 9), (4, 2, 5)])
def test_token_budget_micro_batches_keep_loss_and_gradients_exact(model_and_batch, world, sp, max_tokens):
    """Micro-batches filled to a token budget per rank (packed streams of up to budget x sp tokens);
    ranks may need different numbers of them, and all run the largest count."""
    path, batch, (ref_metrics, ref_grads, ref_params) = model_and_batch
    metrics, grads, params = run_distributed(_train_once, world, path, sp, 1, batch, max_tokens)[0]
    _assert_same_step((metrics, grads, params), (ref_metrics, ref_grads, ref_params), path)


SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", SEQ_MODES)
def test_sequence_loss_aggregation_is_exact_across_splits(model_and_batch, mode):
    """verl's sequence-level loss_agg_modes (policy, KL and entropy terms) over the whole mini-batch:
    one rank with two micro-batch splits, dp=2 and Ulysses 2 (sequences cut across ranks) give the
    loss metrics, gradients and AdamW step of one rank with one micro-batch."""
    path, batch, (token_mean_metrics, _, _) = model_and_batch
    loss = dataclasses.replace(LOSS, loss_agg_mode=mode, loss_scale_factor=None if mode != SEQ_MODES[2] else 11)
    ref = run_distributed(_train_once, 1, path, 1, B, batch, None, -1, 1, 1, True, loss)[0]
    assert abs(ref[0]["actor/pg_loss"] - token_mean_metrics["actor/pg_loss"]) > 1e-4  # the mode changes the loss
    for world, sp, micro in ((1, 1, 3), (2, 1, 2), (2, 2, 3)):
        got = run_distributed(_train_once, world, path, sp, micro, batch, None, -1, 1, 1, True, loss)[0]
        _assert_same_step(got, ref, path)


def _role_update(rank: int, world: int, model_path: str, sp: int, overrides: dict, batch: Batch):
    """One update_actor call of an ActorRole built from a config (its loss keys read as in a run): one
    mini-batch of the whole batch, micro-batches of 3 rows."""
    from omegaconf import OmegaConf

    from rlsp.config.layout import ParallelLayout, RoleLayout, World
    from rlsp.config.schema import RLSPConfig
    from rlsp.workers.context import RoleContext
    from rlsp.workers.roles.actor import ActorRole

    cfg = OmegaConf.structured(RLSPConfig)
    a = "actor_rollout_ref.actor."
    for key, val in {"trainer.n_gpus_per_node": world, "actor_rollout_ref.model.path": model_path,
                     "data.max_prompt_length": P, "actor_rollout_ref.rollout.n": 1, a + "ppo_mini_batch_size": B,
                     a + "ppo_micro_batch_size_per_gpu": 3, a + "ulysses_sequence_parallel_size": sp,
                     a + "optim.grad_clip": 0.0, a + "kl_loss_coef": LOSS.kl_loss_coef,
                     a + "entropy_coeff": LOSS.entropy_coeff, **overrides}.items():
        OmegaConf.update(cfg, key, val)
    actor = RoleLayout(World(1, world), ulysses=sp)
    role = ActorRole(RoleContext(cfg, rank, ParallelLayout(World(1, world), actor, actor), torch.device("cpu"), 0))
    dims = role.engine.dims
    metrics = role.update_actor(batch.chunk(dims.dp_size)[dims.dp_rank])
    return metrics if rank == 0 else None


@pytest.mark.parametrize("mode,scale", [("seq-mean-token-mean", None), ("seq-mean-token-sum-norm", 11)])
def test_actor_role_reads_loss_agg_mode(model_and_batch, mode, scale):
    """actor.loss_agg_mode / loss_scale_factor reach the loss through ActorRole.update_actor: its loss
    metrics are the engine-level ones of that mode, and the same on one rank, dp=2 and Ulysses 2."""
    path, batch, _ = model_and_batch
    overrides = {"actor_rollout_ref.actor.loss_agg_mode": mode, "actor_rollout_ref.actor.loss_scale_factor": scale}
    loss = dataclasses.replace(LOSS, loss_agg_mode=mode, loss_scale_factor=scale)
    expected = run_distributed(_train_once, 1, path, 1, 3, batch, None, -1, 1, 1, True, loss)[0][0]
    metric_rtol, _, scale = tolerances(path)
    for world, sp in ((1, 1), (2, 1), (2, 2)):
        metrics = run_distributed(_role_update, world, path, sp, overrides, batch)[0]
        assert_scalars_close(metrics, expected, METRICS, metric_rtol, scale)
