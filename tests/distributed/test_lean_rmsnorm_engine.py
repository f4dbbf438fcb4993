"""Lean RMSNorm in the engine, built by the roles from `*.model.lean_rmsnorm`: against the same engine
without it (same layout, same micro-batches), the actor's logprobs and the critic's values are
bit-identical (the lean forward is HF's arithmetic op for op), and the loss metrics, every gradient
and an AdamW step agree within fp32 rounding — alone, with Ulysses 2 and gradient checkpointing, and
with LoRA adapters (frozen norm weights: the lean backward skips their gradient), and under tensor
parallelism 2 with and without sequence-parallel norms (the norms then run on DTensors).

Tolerances: a norm's analytic backward differs from autograd's by at most 2 (H + 8) u of its scale
per element (tests/unit/test_rms_norm.py derives it), a reduction over the width like the others that
tests/tolerances.py counts: metrics, gradients and the AdamW step within its bounds for the model, as
test_fsdp_engine's `_assert_same_step` checks them.
"""

from __future__ import annotations

import pytest
import torch
from _launch import run_distributed
from test_critic_exact import SPECS, _with_critic_fields
from test_fsdp_engine import P, _rollout_batch
from test_tiled_mlp_engine import MICRO, _assert_same, _config, update_once

from rlsp.config.layout import ParallelLayout, RoleLayout, World
from rlsp.data.batch import Batch
from rlsp.models.rms_norm import LeanRMSNorm
from rlsp.models.tiny import build_tiny_model
from rlsp.workers.context import RoleContext
from rlsp.workers.roles.actor import ActorRole
from rlsp.workers.roles.critic import CriticRole

pytestmark = pytest.mark.distributed


def _layout(cfg, world: int) -> ParallelLayout:
    """The roles' degrees on one node of `world` workers, tensor parallelism included."""
    policy = World(1, world)

    def role(section) -> RoleLayout:
        return RoleLayout(policy, ulysses=section.ulysses_sequence_parallel_size, tp=section.tensor_model_parallel_size,
                          sequence_parallel=section.sequence_parallel)

    actor = role(cfg.actor_rollout_ref.actor)
    return ParallelLayout(policy, actor, actor, role(cfg.critic))


def _step(rank: int, world: int, path: str, role: str, overrides: dict, batch: Batch):
    """The role's forward outputs, then one update (backward over the micro-batches, AdamW step)."""
    cfg = _config(path, world, role, overrides)
    ctx = RoleContext(cfg, rank, _layout(cfg, world), torch.device("cpu"), pad_token_id=0)
    engine = (ActorRole(ctx) if role == "actor" else CriticRole(ctx)).engine
    key = "logprobs" if role == "actor" else "values"
    head = {"temperature": 1.0} if role == "actor" else {}
    forward = engine.infer(batch, P, MICRO, key, **head)
    metrics, grads, params = update_once(engine, batch, role)
    lean = sum(isinstance(m, LeanRMSNorm) for m in engine.module.modules())
    return {"forward": forward, "metrics": metrics, "grads": grads, "params": params, "lean": lean}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_model(SPECS["4q2kv"], str(tmp_path_factory.mktemp("tiny")))
    from transformers import AutoConfig

    return path, _with_critic_fields(_rollout_batch(AutoConfig.from_pretrained(path).vocab_size))


def _compare(path: str, batch: Batch, role: str, world: int, overrides: dict, model: str, metric_keys) -> None:
    plain = run_distributed(_step, world, path, role, overrides, batch)
    lean = run_distributed(_step, world, path, role, {**overrides, f"{model}.lean_rmsnorm": True}, batch)
    for out, ref in zip(lean, plain):
        assert out["lean"] == 5 and ref["lean"] == 0  # two per decoder layer and the final norm
        assert torch.equal(out["forward"], ref["forward"])
        _assert_same(out, ref, metric_keys, path)


ACTOR = "actor_rollout_ref.actor"
ACTOR_MODEL = "actor_rollout_ref.model"
CASES = {  # world, overrides
    "one-rank": (1, {}),
    "ulysses2-checkpointing": (2, {f"{ACTOR}.ulysses_sequence_parallel_size": 2,
                                   f"{ACTOR_MODEL}.enable_gradient_checkpointing": True}),
    "dp2-lora": (2, {f"{ACTOR_MODEL}.lora_rank": 4, f"{ACTOR_MODEL}.lora_alpha": 8}),
    # norms on DTensors: the residual sharded along the sequence, or replicated
    "tp2-sequence-parallel": (2, {f"{ACTOR}.tensor_model_parallel_size": 2, f"{ACTOR}.sequence_parallel": True}),
    "tp2-replicated": (2, {f"{ACTOR}.tensor_model_parallel_size": 2, f"{ACTOR}.sequence_parallel": False}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_actor_with_lean_rmsnorm_matches_hf_norms(setup, case):
    path, batch = setup
    world, overrides = CASES[case]
    _compare(path, batch, "actor", world, overrides, ACTOR_MODEL, ("actor/pg_loss", "actor/kl_loss", "actor/entropy"))


@pytest.mark.parametrize("overrides", [
    {"critic.ulysses_sequence_parallel_size": 2, "critic.model.enable_gradient_checkpointing": True},
    {"critic.tensor_model_parallel_size": 2},
])
def test_critic_with_lean_rmsnorm_matches_hf_norms(setup, overrides):
    path, batch = setup
    _compare(path, batch, "critic", 2, overrides, "critic.model", ("critic/vf_loss", "critic/vpred_mean"))
