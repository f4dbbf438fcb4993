"""Tiled MLP and activation offload in the engine, built by the roles from the config keys: the actor's
loss metrics, every parameter's gradient and an AdamW step, and the critic's value loss, gradients and
step, equal the plain engine's (one rank, no tiling, no checkpointing) at dp 2, Ulysses 2 and ring 2.

Engines are built by `ActorRole` / `CriticRole` from a config, so the keys
`*.model.tiled_mlp.*`, `*.model.enable_gradient_checkpointing` and `*.model.enable_activation_offload`
are exercised as a run uses them. Tolerances as in test_fsdp_engine (`_assert_same_step`): metrics,
gradients and the AdamW step within the bounds tests/tolerances.py derives for the model. On CPU the
offload is a no-op that must say so exactly once per rank, however many micro-batches run.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _launch import run_distributed
from omegaconf import OmegaConf
from test_critic_exact import CLIP, SPECS, _with_critic_fields
from test_fsdp_engine import LOSS, LR, P, _assert_same_step, _rollout_batch

from rlsp.config.layout import ParallelLayout, RoleLayout, World
from rlsp.config.schema import RLSPConfig
from rlsp.data.batch import Batch
from rlsp.models.tiled_mlp import TiledMLP
from rlsp.models.tiny import build_tiny_model
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.context import RoleContext
from rlsp.workers.critic_loss import make_critic_loss
from rlsp.workers.ppo_loop import global_token_count
from rlsp.workers.roles.actor import ActorRole
from rlsp.workers.roles.critic import CriticRole

pytestmark = pytest.mark.distributed

MICRO = 3  # rows per micro-batch: several micro-batches per rank


def update_once(engine, batch: Batch, role: str) -> tuple[dict, dict, dict]:  # noqa: ANN001 (an FSDPEngine)
    """One update of this rank's share of `batch`: (metrics, full gradients, full parameters after AdamW)."""
    shard = batch.chunk(engine.dims.dp_size)[engine.dims.dp_rank]
    count = global_token_count(shard, engine.dims.dp_group)
    if role == "actor":
        loss_fn, kwargs = make_actor_loss(LOSS, count), {"temperature": 1.0, "with_entropy": True}
    else:
        loss_fn, kwargs = make_critic_loss(CLIP, count), {}
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(shard, P, MICRO, loss_fn, None, **kwargs)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    engine.optimizer.step()
    return metrics, grads, {k: v.clone() for k, v in engine.iter_full_params()}


NO_EFFECT = "activation offload (enable_activation_offload=true) has no effect on cpu"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _config(path: str, world: int, role: str, overrides: dict) -> object:
    cfg = OmegaConf.structured(RLSPConfig)
    base = {"trainer.n_gpus_per_node": world, "actor_rollout_ref.model.path": path,
            "actor_rollout_ref.actor.optim.lr": LR, "actor_rollout_ref.actor.optim.grad_clip": 0.0,
            "critic.optim.lr": LR, "critic.optim.grad_clip": 0.0}
    for key, val in {**base, **overrides}.items():
        OmegaConf.update(cfg, key, val)
    return cfg


def _layout(cfg, world: int) -> ParallelLayout:
    """The roles' degrees on one node of `world` workers (the config's values; validated elsewhere)."""
    policy = World(1, world)

    def role(section) -> RoleLayout:
        return RoleLayout(policy, ulysses=section.ulysses_sequence_parallel_size,
                          ring=section.ring_sequence_parallel_size)

    actor = role(cfg.actor_rollout_ref.actor)
    return ParallelLayout(policy, actor, actor, role(cfg.critic))


def _step(rank: int, world: int, path: str, role: str, overrides: dict, batch: Batch):
    """One update (backward over the micro-batches, AdamW step) of the engine `role` builds."""
    cfg = _config(path, world, role, overrides)
    records, logger = _Records(), logging.getLogger("rlsp.engine.offload")
    logger.addHandler(records)
    try:
        ctx = RoleContext(cfg, rank, _layout(cfg, world), torch.device("cpu"), pad_token_id=0)
        engine = (ActorRole(ctx) if role == "actor" else CriticRole(ctx)).engine
        metrics, grads, params = update_once(engine, batch, role)
    finally:
        logger.removeHandler(records)
    tiled = sum(isinstance(m, TiledMLP) for m in engine.module.modules())
    return {"metrics": metrics, "grads": grads, "params": params, "log": records.lines, "tiled": tiled}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny_model(SPECS["4q2kv"], str(tmp_path_factory.mktemp("tiny")))
    from transformers import AutoConfig

    batch = _with_critic_fields(_rollout_batch(AutoConfig.from_pretrained(path).vocab_size))
    refs = {role: run_distributed(_step, 1, path, role, {}, batch)[0] for role in ("actor", "critic")}
    return path, batch, refs


def _assert_same(out: dict, ref: dict, keys: tuple[str, ...], path: str) -> None:
    """Metrics, every gradient and the AdamW step (lr LR, set below) as the reference's, within the bounds
    tests/tolerances.py derives (a tied lm_head.weight is the embedding, checked under its own name)."""
    _assert_same_step((out["metrics"], out["grads"], out["params"]), (ref["metrics"], ref["grads"], ref["params"]),
                      path, keys)


def _overrides(model: str, tiled: int, ckpt: bool, offload: bool, degrees: tuple[int, int], section: str) -> dict:
    ulysses, ring = degrees
    out = {f"{section}.ulysses_sequence_parallel_size": ulysses, f"{section}.ring_sequence_parallel_size": ring,
           f"{model}.enable_gradient_checkpointing": ckpt, f"{model}.enable_activation_offload": offload}
    if tiled:
        out |= {f"{model}.tiled_mlp.enabled": True, f"{model}.tiled_mlp.num_shards": tiled}
    return out


CASES = [  # (ulysses, ring), tiles (0 = off), gradient checkpointing, activation offload
    ((1, 1), 3, False, False), ((2, 1), 4, False, False), ((1, 2), 5, False, False),
    ((1, 1), 2, True, True), ((2, 1), 0, True, True),
]


@pytest.mark.parametrize("degrees,tiles,ckpt,offload", CASES)
def test_actor_with_tiled_mlp_and_offload_matches_plain_engine(setup, degrees, tiles, ckpt, offload):
    path, batch, refs = setup
    overrides = _overrides("actor_rollout_ref.model", tiles, ckpt, offload, degrees, "actor_rollout_ref.actor")
    outs = run_distributed(_step, 2, path, "actor", overrides, batch)
    _assert_same(outs[0], refs["actor"], ("actor/pg_loss", "actor/kl_loss", "actor/entropy"), path)
    for out in outs:
        assert out["tiled"] == (2 if tiles else 0)  # both decoder layers
        assert [line.startswith(NO_EFFECT) for line in out["log"]] == ([True] if offload else [])


@pytest.mark.parametrize("degrees,tiles,ckpt,offload", [((1, 1), 3, False, False), ((2, 1), 4, False, False),
                                                        ((1, 2), 5, True, True)])
def test_critic_with_tiled_mlp_and_offload_matches_plain_engine(setup, degrees, tiles, ckpt, offload):
    path, batch, refs = setup
    outs = run_distributed(_step, 2, path, "critic", _overrides("critic.model", tiles, ckpt, offload, degrees,
                                                                "critic"), batch)
    _assert_same(outs[0], refs["critic"], ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"), path)
    assert "value_head.weight" in outs[0]["grads"]
    for out in outs:
        assert out["tiled"] == 2 and [line.startswith(NO_EFFECT) for line in out["log"]] == ([True] if offload else [])
