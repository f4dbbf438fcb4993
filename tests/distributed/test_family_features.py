"""Memory and layout features on one tiny model of each new attention kind, at Ulysses 2 against one process.

Families (tests/tiny_gemma.py, tiny_gpt_oss.py, tiny_deepseek.py, tiny_linear.py): gemma2 (sliding windows,
attention and final-logit soft-capping), gpt_oss (windows, sinks, MoE with clamped SwiGLU), deepseek_v3
(multi-latent attention, MoE) and qwen3_next (Gated DeltaNet, MoE). Features, switched on by the config keys a run
uses (the engine is built by `ActorRole`, as tests/distributed/test_tiled_mlp_engine.py does): tiled MLP,
gradient checkpointing with activation offload (a logged no-op on CPU), token-budget micro-batches
(`use_dynamic_bsz`: the engine's `max_tokens`), adaptive Ulysses (`sequence_parallel_adaptive`), LoRA, lean
RMSNorm. Each run's loss metrics, every parameter's full gradient and the AdamW step equal one process's (the same
feature off, or for LoRA on, at Ulysses 1) within tests/tolerances.py's bounds (`_assert_same_step`).

Refused before workers start (tests/unit/test_family_feature_checks.py): tiled MLP on MoE layers (gpt_oss,
deepseek_v3, qwen3_next), lean RMSNorm on (1 + weight) norms (gemma2, qwen3_next), LoRA where peft moves the MLP
targets onto fused expert parameters (deepseek_v3, qwen3_next).

Each run also shows the feature ran (tiled MLPs on every layer, adapters, lean norms, Ulysses degrees 1 and 2,
another micro-batch count, checkpointing on and the offload's cpu no-op logged once).

CI runs CASES (11 runs, ~40 s): each feature on two families where two take it, every family on at least two.
Run by hand beyond CI (same test, every pair not refused), all passing; worst relative gradient error against
the bound 3.2e-5 (metrics: <= 3.4e-7 against 1.6e-5): gemma2 tiled 9.3e-7, checkpoint+offload 3.3e-7, token budget
4.9e-7, adaptive 7.2e-7, LoRA 3.0e-7; gpt_oss checkpoint+offload 1.9e-6, token budget 7.5e-6, adaptive 1.8e-6,
LoRA 1.7e-6, lean 1.9e-6; deepseek_v3 checkpoint+offload 1.5e-6, token budget 1.6e-6, adaptive 1.7e-6, lean
1.5e-6; qwen3_next checkpoint+offload 1.9e-6, token budget 3.3e-6, adaptive 3.6e-6.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _launch import run_distributed
from test_fsdp_engine import LOSS, P, _assert_same_step, _rollout_batch
from test_tiled_mlp_engine import MICRO, NO_EFFECT, _config, _Records
from tiny_deepseek import write_tiny_deepseek
from tiny_gemma import write_tiny_gemma
from tiny_gpt_oss import write_tiny_gpt_oss
from tiny_linear import write_tiny_linear
from transformers import AutoConfig

from rlsp.config.layout import ParallelLayout, RoleLayout, World
from rlsp.data.batch import Batch
from rlsp.models.lora import is_adapter_param
from rlsp.models.rms_norm import LeanRMSNorm
from rlsp.models.tiled_mlp import TiledMLP
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.context import RoleContext
from rlsp.workers.ppo_loop import global_token_count
from rlsp.workers.roles.actor import ActorRole

pytestmark = pytest.mark.distributed

MODEL, ACTOR = "actor_rollout_ref.model", "actor_rollout_ref.actor"
METRIC_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy")
BUDGET = 8  # tokens per rank for token-budget micro-batches (rows of 2..13 tokens, split over 2 ranks)
WRITERS = {
    "gemma2": lambda d: write_tiny_gemma("gemma2", d),
    "gpt_oss": write_tiny_gpt_oss,
    "deepseek_v3": lambda d: write_tiny_deepseek("v3", d),
    "qwen3_next": lambda d: write_tiny_linear("qwen3_next", d),
}
LORA = {f"{MODEL}.lora_rank": 4, f"{MODEL}.lora_alpha": 8}
FEATURES = {  # name: (config overrides, token budget or None); LoRA's reference has LoRA on too
    "tiled_mlp": ({f"{MODEL}.tiled_mlp.enabled": True, f"{MODEL}.tiled_mlp.num_shards": 3}, None),
    "checkpoint_offload": ({f"{MODEL}.enable_gradient_checkpointing": True,
                            f"{MODEL}.enable_activation_offload": True}, None),
    "dynamic_bsz": ({f"{ACTOR}.use_dynamic_bsz": True, f"{ACTOR}.ppo_max_token_len_per_gpu": BUDGET}, BUDGET),
    "adaptive_ulysses": ({f"{ACTOR}.sequence_parallel_adaptive": True,
                          f"{ACTOR}.use_dynamic_bsz": True, f"{ACTOR}.ppo_max_token_len_per_gpu": 7}, 7),
    "lora": (LORA, None),
    "lean_rmsnorm": ({f"{MODEL}.lean_rmsnorm": True}, None),
}


def _layout(cfg, world: int) -> ParallelLayout:
    actor = cfg.actor_rollout_ref.actor
    role = RoleLayout(World(1, world), ulysses=actor.ulysses_sequence_parallel_size,
                      adaptive=bool(actor.sequence_parallel_adaptive))
    return ParallelLayout(World(1, world), role, role, None)


def _feature_step(rank: int, world: int, path: str, overrides: dict, max_tokens: int | None, batch: Batch):
    """One actor update (backward over the micro-batches, AdamW step) of the engine `ActorRole` builds, and
    what shows the feature ran: tiled MLPs, lean norms, adapters, and the micro-batches' Ulysses degrees."""
    cfg = _config(path, world, "actor", {f"{ACTOR}.ulysses_sequence_parallel_size": world, **overrides})
    records, logger = _Records(), logging.getLogger("rlsp.engine.offload")
    logger.addHandler(records)
    try:
        engine = ActorRole(RoleContext(cfg, rank, _layout(cfg, world), torch.device("cpu"), pad_token_id=0)).engine
        got = _update(engine, batch, max_tokens)
    finally:
        logger.removeHandler(records)
    modules = list(engine.module.modules())
    shard = batch.chunk(engine.dims.dp_size)[engine.dims.dp_rank]
    plans = [plan for plan, _ in engine._micro_batches(shard, MICRO, max_tokens)]
    seen = {"tiled": sum(isinstance(m, TiledMLP) for m in modules), "lean": sum(isinstance(m, LeanRMSNorm) for m in modules),
            "adapters": sum(is_adapter_param(k) for k in got[1]), "degrees": sorted({p.degree for p in plans}, key=str),
            "micro_batches": (len(plans), len(engine._micro_batches(shard, MICRO, None))),
            "checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in modules),
            "offload_logged": sum(line.startswith(NO_EFFECT) for line in records.lines)}
    return got, seen


def _update(engine, batch: Batch, max_tokens: int | None) -> tuple[dict, dict, dict]:  # noqa: ANN001 (FSDPEngine)
    """Metrics, full gradients and full parameters after one AdamW step over this rank's share of `batch`."""
    shard = batch.chunk(engine.dims.dp_size)[engine.dims.dp_rank]
    loss_fn = make_actor_loss(LOSS, global_token_count(shard, engine.dims.dp_group))
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(shard, P, MICRO, loss_fn, max_tokens, temperature=1.0, with_entropy=True)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    engine.optimizer.step()
    return metrics, grads, {k: v.clone() for k, v in engine.iter_full_params()}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Per family: the model, the batch, and one process's update without features (and with LoRA), made once."""
    cache: dict[tuple[str, bool], tuple] = {}

    def get(family: str, lora: bool) -> tuple:
        if (family, False) not in cache:
            path = WRITERS[family](str(tmp_path_factory.mktemp(family)))
            batch = _rollout_batch(AutoConfig.from_pretrained(path).vocab_size)
            cache[family, False] = (path, batch, run_distributed(_feature_step, 1, path, {}, None, batch)[0][0])
        if lora and (family, True) not in cache:
            path, batch, _ = cache[family, False]
            cache[family, True] = (path, batch, run_distributed(_feature_step, 1, path, LORA, None, batch)[0][0])
        return cache[family, lora]

    return get


def _assert_feature_ran(feature: str, seen: dict, layers: int) -> None:
    """The feature changed what ran (else the comparison would test nothing)."""
    checks = {
        "tiled_mlp": seen["tiled"] == layers,
        "checkpoint_offload": seen["checkpointing"] and seen["offload_logged"] == 1,  # a logged no-op on cpu
        "dynamic_bsz": seen["micro_batches"][0] != seen["micro_batches"][1],  # other rows per micro-batch
        "adaptive_ulysses": seen["degrees"] == [1, 2],
        "lora": seen["adapters"] > 0,
        "lean_rmsnorm": seen["lean"] > 0,
    }
    assert checks[feature], (feature, seen)


CASES = [  # CI: each feature on two families where two take it, every family on at least two features
    ("gemma2", "tiled_mlp"), ("gemma2", "dynamic_bsz"), ("gemma2", "lora"),
    ("gpt_oss", "checkpoint_offload"), ("gpt_oss", "adaptive_ulysses"), ("gpt_oss", "lora"), ("gpt_oss", "lean_rmsnorm"),
    ("deepseek_v3", "dynamic_bsz"), ("deepseek_v3", "lean_rmsnorm"),
    ("qwen3_next", "checkpoint_offload"), ("qwen3_next", "adaptive_ulysses"),
]


@pytest.mark.parametrize("family,feature", CASES)
def test_feature_at_ulysses_2_matches_one_process(references, family, feature):
    path, batch, reference = references(family, feature == "lora")
    overrides, max_tokens = FEATURES[feature]
    got, seen = run_distributed(_feature_step, 2, path, overrides, max_tokens, batch)[0]
    _assert_feature_ran(feature, seen, AutoConfig.from_pretrained(path).num_hidden_layers)
    _assert_same_step(got, reference, path, METRIC_KEYS)
