"""The vision-language critic trains exactly under Ulysses and ring: its values, value loss, every gradient (the vision
tower's included) and the AdamW step equal one process's.

A tiny Qwen3-VL (tests/tiny_vl.py: 6 q / 2 kv heads, deepstack into both text layers) loaded as the critic loads it
(`load_backbone(..., vision_tower=True)` -> `rlsp.models.value.VisionValueModel`, seeded value head) goes through the
FSDP2 engine on rows with 0, 1 and 2 images, micro-batches of 3 rows (so some ranks encode no image of their own and
run the blank one). At Ulysses 2 (heads 3+3 / kv 1+1), ring 2 and dp 2 x Ulysses 2 the per-token values, the
value-loss metrics, every parameter's full gradient and the AdamW step equal one process's within
tests/tolerances.py's bounds (the bounds count the tower's layers as stages of the chain). With `freeze_vision_tower`
(Ulysses 2) no tower parameter gets a gradient or a step, and the text model's and the head's equal the reference's.
Qwen3-VL-MoE and Qwen3.5 (loaded with its tower) the same at Ulysses 2. The critic's checkpoint (DCP, unchanged
format) written at Ulysses 2 restores on one process.
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_critic_exact import CLIP, CRITIC_METRICS
from tiny_vl import vl_rows, write_tiny_vl
from tolerances import assert_adam_step_close, assert_grads_close, assert_scalars_close, assert_tensor_close, model_rtol

from rlsp.data.batch import Batch
from rlsp.engine.checkpoint import load_engine, save_engine
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.models.loading import load_backbone
from rlsp.models.value import VisionValueModel, build_value_model
from rlsp.workers.critic_loss import make_critic_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed

P, R = 22, 6
LR = 1e-3
GRIDS = [[], [[1, 4, 4]], [[1, 2, 4], [1, 4, 6]], [[1, 4, 2]], [], [[1, 2, 2]]]
TOKENS = len(GRIDS) * (P + R)
TOWER = "backbone.visual."


def _critic_rows() -> Batch:
    batch = vl_rows(GRIDS, P, R)
    g = torch.Generator().manual_seed(7)
    mask = batch["response_mask"]
    batch.set("values", torch.randn(mask.shape, generator=g) * 0.3 * mask)
    batch.set("returns", torch.randn(mask.shape, generator=g) * mask)
    return batch


def _critic_engine(path: str, dims, freeze: bool = False) -> FSDPEngine:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same head on every rank, as the critic role seeds it
        module = build_value_model(load_backbone(path, vision_tower=True), init_std=0.5, freeze_vision_tower=freeze)
    assert isinstance(module, VisionValueModel)
    return FSDPEngine(module, dims, torch.device("cpu"), optim=OptimSettings(lr=LR, grad_clip=0.0))


def _train_once(rank: int, world: int, path: str, ulysses: int, ring: int, batch: Batch, freeze: bool = False,
                save_to: str | None = None):
    dims = layout_dims(ulysses=ulysses, ring=ring)
    engine = _critic_engine(path, dims, freeze)
    values = engine.infer(batch, P, 3, "values")  # every rank gets the whole batch: the sp ranks split it
    shard = batch.chunk(dims.dp_size)[dims.dp_rank]
    engine.optimizer.zero_grad(set_to_none=True)
    loss_fn = make_critic_loss(CLIP, *global_counts(shard, dims.dp_group), "token-mean")
    metrics = engine.backward_batch(shard, P, 3, loss_fn)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    tower = {k: v.clone() for k, v in engine.iter_full_params() if k.startswith(TOWER)}
    engine.optimizer.step()
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    if freeze:  # the tower keeps its weights
        assert tower and all(torch.equal(params[k], v) for k, v in tower.items())
    if save_to is not None:
        save_engine(engine, save_to)
    return (values, metrics, grads, params) if rank == 0 else None


def _load_once(rank: int, world: int, path: str, ckpt: str):
    """A fresh critic engine (one process) restored from `ckpt`: its full weights and AdamW moments."""
    engine = _critic_engine(path, layout_dims())
    load_engine(engine, ckpt)
    moments = {n: engine.optimizer.state[p]["exp_avg"].clone() for n, p in engine.module.named_parameters()}
    return {k: v.clone() for k, v in engine.iter_full_params()}, moments


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    family = getattr(request, "param", "qwen3_vl")
    path = write_tiny_vl(family, str(tmp_path_factory.mktemp(family)))
    batch = _critic_rows()
    return path, batch, run_distributed(_train_once, 1, path, 1, 1, batch)[0]


def _bounds(path: str, ref_values: torch.Tensor) -> tuple[float, float, float]:
    """(value / metric rtol, gradient rtol, scale): model_rtol over the text layers and the tower's blocks."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return model_rtol(config, TOKENS, backward=False), model_rtol(config, TOKENS), float(ref_values.abs().max())


# Qwen3-VL at Ulysses 2, ring 2 and dp 2 x Ulysses 2; Qwen3-VL-MoE and Qwen3.5 (Gated DeltaNet layers, a tower without
# deepstack, loaded with it) at Ulysses 2
@pytest.mark.parametrize("reference,world,ulysses,ring", [
    ("qwen3_vl", 2, 2, 1), ("qwen3_vl", 2, 1, 2), ("qwen3_vl", 4, 2, 1), ("qwen3_vl_moe", 2, 2, 1),
    ("qwen3_5", 2, 2, 1)], indirect=["reference"])
def test_vision_critic_values_loss_gradients_and_step_exact(reference, world, ulysses, ring):
    """The layouts give the one-process critic's values, loss, gradients and AdamW step."""
    path, batch, (ref_values, ref_metrics, ref_grads, ref_params) = reference
    values, metrics, grads, params = run_distributed(_train_once, world, path, ulysses, ring, batch)[0]
    mask = batch["response_mask"].bool()
    assert float(ref_values[mask].abs().min()) > 0.0  # real values on every response token
    assert any(k.startswith(TOWER) for k in ref_grads) and "value_head.weight" in ref_grads  # the tower trains
    rtol, grad_rtol, scale = _bounds(path, ref_values)
    assert_tensor_close(values, ref_values, rtol, scale)
    assert_scalars_close(metrics, ref_metrics, CRITIC_METRICS, rtol, scale)
    assert ref_metrics["critic/vf_loss"] > 0 and 0 < ref_metrics["critic/vf_clipfrac"] < 1
    assert_grads_close(grads, ref_grads, grad_rtol)
    assert_adam_step_close(params, ref_params, grads, ref_grads, LR)


def test_frozen_critic_tower_at_ulysses_2(reference):
    """critic.model.freeze_vision_tower: no tower gradient or step anywhere; the text model's and the head's
    gradients and step are the trained tower's reference's (the tower's weights are the same in both forwards)."""
    path, batch, (ref_values, ref_metrics, ref_grads, ref_params) = reference
    values, metrics, grads, params = run_distributed(_train_once, 2, path, 2, 1, batch, True)[0]
    ref_grads = {k: v for k, v in ref_grads.items() if not k.startswith(TOWER)}
    assert grads.keys() == ref_grads.keys()
    rtol, grad_rtol, scale = _bounds(path, ref_values)
    assert_tensor_close(values, ref_values, rtol, scale)
    assert_scalars_close(metrics, ref_metrics, CRITIC_METRICS, rtol, scale)
    assert_grads_close(grads, ref_grads, grad_rtol)
    text = [k for k in params if not k.startswith(TOWER)]
    assert_adam_step_close({k: params[k] for k in text}, {k: ref_params[k] for k in text}, grads, ref_grads, LR)


def test_vision_critic_checkpoint_written_at_ulysses_2_loads_on_one_rank(reference, tmp_path):
    """The critic's checkpoint (the engine's DCP state, as before: backbone with its tower, value head, optimizer)
    written at Ulysses 2 restores on one process: every weight equal to the saved one, AdamW's moments present."""
    path, batch, _ = reference
    ckpt = str(tmp_path / "critic")
    _, _, _, params = run_distributed(_train_once, 2, path, 2, 1, batch, False, ckpt)[0]
    loaded, moments = run_distributed(_load_once, 1, path, ckpt)[0]
    assert loaded.keys() == params.keys() and any(k.startswith(TOWER) for k in loaded)
    assert all(torch.equal(loaded[k], params[k]) for k in params)
    assert moments.keys() == params.keys()  # every parameter's AdamW state came back (the tower's included)
    assert any(m.abs().sum() > 0 for k, m in moments.items() if k.startswith(TOWER))
