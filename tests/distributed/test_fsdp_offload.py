"""FSDP2 parameter offload (CPUOffloadPolicy) changes nothing but where the shards live.

On CPU FSDP2 accepts the policy, so the engine applies it here exactly as on a GPU: the test checks
that it is applied (every FSDP unit's parameter group carries it), and that a training step with it
equals one without it — loss metrics, gradient norm (the clipped norm goes through the offload-aware
path), every full gradient and every parameter after the AdamW step, bit for bit — at dp=2 and at
tp=2 (FSDP2 x tensor parallelism); a frozen engine's logprobs equal too. Also the policy's
construction per device and the once-per-role log line.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS, P, _rollout_batch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.fsdp_offload import build_offload_policy, log_offload
from rlsp.engine.optim import OptimSettings
from rlsp.models.lm import TokenLogprobModel
from rlsp.models.loading import load_causal_lm
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.workers.actor_loss import make_actor_loss

pytestmark = pytest.mark.distributed


def _engine(path: str, dims, offload: bool, trainable: bool = True) -> FSDPEngine:
    lm = load_causal_lm(path, dtype=torch.float32)
    optim = OptimSettings(lr=1e-3, grad_clip=0.5) if trainable else None  # clipping active: norms ~1
    return FSDPEngine(TokenLogprobModel(lm), dims, torch.device("cpu"), optim=optim, param_offload=offload)


def _policies(engine: FSDPEngine) -> set[type]:
    return {type(m._get_fsdp_state()._fsdp_param_group.offload_policy)
            for m in engine.module.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group}


def _step(rank: int, world: int, path: str, batch, tp: int, offload: bool):
    dims = layout_dims(tp=tp)
    engine = _engine(path, dims, offload)
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    count = shard["response_mask"].sum().double().reshape(1)
    dist.all_reduce(count, group=dims.dp_group)
    grads: dict[str, torch.Tensor] = {}
    real_step = engine.optimizer.step

    def step_after_capture(*args, **kwargs):  # the gradients the optimizer sees (after clipping)
        grads.update({k: v.clone() for k, v in engine.iter_full_grads()})
        return real_step(*args, **kwargs)

    engine.optimizer.step = step_after_capture
    metrics = engine.train_step(shard, P, 3, make_actor_loss(LOSS, float(count)), temperature=1.0, with_entropy=True)
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    frozen = _engine(path, dims, offload, trainable=False)
    logprobs = frozen.infer(batch, P, 4, "logprobs", temperature=1.0)
    policies = _policies(engine) | _policies(frozen)
    return (metrics, grads, params, logprobs, policies) if rank == 0 else None


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, init_std=0.2), str(tmp_path_factory.mktemp("tiny")))
    from transformers import AutoConfig

    return path, _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)


@pytest.mark.parametrize("tp", [1, 2])
def test_offloaded_step_equals_the_plain_one(setup, tp):
    path, batch = setup
    plain = run_distributed(_step, 2, path, batch, tp, False)[0]
    off = run_distributed(_step, 2, path, batch, tp, True)[0]
    assert plain[4] == {OffloadPolicy} and off[4] == {CPUOffloadPolicy}
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "grad_norm"):
        assert off[0][key] == plain[0][key], (key, off[0][key], plain[0][key])
    assert plain[0]["grad_norm"] > 0.5  # the clip was active
    for got, want in ((off[1], plain[1]), (off[2], plain[2])):
        assert got.keys() == want.keys() and len(want) > 0
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    torch.testing.assert_close(off[3], plain[3], rtol=0, atol=0)


def test_policy_per_device_and_one_log_line(caplog):
    assert type(build_offload_policy(False, torch.device("cuda"))) is OffloadPolicy
    assert build_offload_policy(True, torch.device("cuda")).pin_memory is True
    cpu = build_offload_policy(True, torch.device("cpu"))
    assert isinstance(cpu, CPUOffloadPolicy) and cpu.pin_memory is False  # pinning needs CUDA
    with caplog.at_level(logging.INFO, logger="rlsp.engine"):
        for _ in range(3):
            log_offload("critic-test", True, torch.device("cpu"))
        log_offload("ref-test", False, torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if "offload" in r.getMessage()]
    assert lines == ["critic-test: FSDP parameter offload (CPUOffloadPolicy) has no effect on cpu: parameters, "
                     "gradients and optimizer state already live in host memory"]
