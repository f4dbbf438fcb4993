"""The engine's precision policy and its saveable state.

* With model.dtype=bfloat16 the master weights and AdamW state stay fp32 and an lr-1e-6 step moves
  as many parameters as the fp32 run does; weights held in bf16 themselves (the old behaviour) lose
  most of that step to rounding — the check the test relies on can fail.
* state_dict()/load_state_dict() restore model, optimizer and LR schedule: a fresh engine loaded
  from a trained one takes exactly the same next step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS, P, _rollout_batch, policy_engine

from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.workers.actor_loss import make_actor_loss

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def model_and_batch(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    path = build_tiny_model(spec, str(tmp_path_factory.mktemp("tiny")))
    from transformers import AutoConfig

    return path, _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)


def _step(engine: FSDPEngine, batch) -> dict[str, float]:
    count = float(batch["response_mask"].sum())
    return engine.train_step(batch, P, 4, make_actor_loss(LOSS, count), temperature=1.0, with_entropy=True)


def _changed_fraction(rank: int, world: int, path: str, batch, mode: str):
    dims = layout_dims()
    if mode == "pure_bf16":  # weights and optimizer state in bf16: what mixed precision replaces
        lm = load_causal_lm(path, dtype=torch.bfloat16)
        engine = FSDPEngine(TokenLogprobModel(lm), dims, torch.device("cpu"), compute_dtype=torch.bfloat16,
                            optim=OptimSettings(lr=1e-6, grad_clip=0.0))
    else:
        compute = torch.bfloat16 if mode == "bf16" else torch.float32
        engine = policy_engine(path, dims, lr=1e-6, compute_dtype=compute)
    master = {p.dtype for p in engine.module.parameters()}
    before = {k: v.clone() for k, v in engine.iter_full_params()}
    _step(engine, batch)
    state = {v.dtype for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0}
    changed = sum(int((v != before[k]).sum()) for k, v in engine.iter_full_params() if k in before)
    total = sum(v.numel() for v in before.values())
    return (changed / total, master, state) if rank == 0 else None


def test_bf16_compute_keeps_fp32_master_weights_and_small_steps(model_and_batch):
    path, batch = model_and_batch
    fp32, fp32_master, _ = run_distributed(_changed_fraction, 2, path, batch, "fp32")[0]
    bf16, bf16_master, bf16_state = run_distributed(_changed_fraction, 2, path, batch, "bf16")[0]
    pure, pure_master, _ = run_distributed(_changed_fraction, 2, path, batch, "pure_bf16")[0]
    assert fp32_master == bf16_master == {torch.float32} and bf16_state == {torch.float32}
    assert pure_master == {torch.bfloat16}
    assert fp32 > 0.5, f"an lr-1e-6 AdamW step changed only {fp32:.1%} of the fp32 weights"
    assert bf16 >= 0.97 * fp32, f"bf16 compute changed {bf16:.1%} of the weights, fp32 {fp32:.1%}"
    assert pure < 0.5 * fp32, f"bf16 weights kept {pure:.1%} of the step (fp32: {fp32:.1%})"


def _resume_equal(rank: int, world: int, path: str, batch):
    dims = layout_dims()
    trained = policy_engine(path, dims, lr=1e-2)
    _step(trained, batch)
    state = trained.state_dict()
    fresh = policy_engine(path, dims, lr=1e-2)
    # A copy, as a checkpoint read back from disk would be: the optimizer keeps the tensors it is given.
    fresh.load_state_dict(copy.deepcopy(state))
    same_before = all(torch.equal(a, b) for (_, a), (_, b) in zip(trained.iter_full_params(), fresh.iter_full_params()))
    m1, m2 = _step(trained, batch), _step(fresh, batch)
    after = [torch.equal(a, b) for (_, a), (_, b) in zip(trained.iter_full_params(), fresh.iter_full_params())]
    untouched = policy_engine(path, dims, lr=1e-2)
    _step(untouched, batch)
    moved = not all(torch.equal(a, b) for (_, a), (_, b) in zip(trained.iter_full_params(), untouched.iter_full_params()))
    dist.barrier()
    return (same_before, all(after), m1, m2, moved, trained.scheduler.state_dict(), fresh.scheduler.state_dict()) \
        if rank == 0 else None


def test_state_dict_round_trip_gives_the_same_next_step(model_and_batch):
    path, batch = model_and_batch
    same_before, same_after, m1, m2, moved, sched1, sched2 = run_distributed(_resume_equal, 2, path, batch)[0]
    assert same_before and same_after
    timing = ("time_",)  # wall-clock split of the step: differs run to run
    assert {k: v for k, v in m1.items() if not k.startswith(timing)} == {
        k: v for k, v in m2.items() if not k.startswith(timing)}
    assert moved  # the loaded state mattered: a fresh engine without it lands elsewhere
    assert sched1 == sched2 and sched1["last_epoch"] == 2
