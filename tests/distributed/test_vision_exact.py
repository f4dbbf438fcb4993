"""Vision-language models train exactly under Ulysses and ring: images spread over the ranks, visual tokens gathered.

Tiny Qwen3-VL, Qwen2.5-VL and Qwen3-VL-MoE models (tests/tiny_vl.py: 6 q / 2 kv heads, vision towers of depth 2, Qwen3-VL's
deepstack into both text layers) go through the FSDP2 policy engine with `rlsp.models.vision_lm.VisionLogprobModel`
on rows with 0, 1 and 2 images, two micro-batches of 3 rows (so some ranks encode no image of their own and run the
blank one). At Ulysses 2, Ulysses 4 (uneven 2+2+1+1 q heads), ring 2 and Ulysses 2 x ring 2 the loss metrics, every
parameter's full gradient (the vision tower's included) and the AdamW step equal one process's within
tests/tolerances.py's bounds; the bounds count the tower's layers as stages of the chain. With the tower frozen
(Ulysses 2) no tower parameter gets a gradient or a step, and the text model's equal the reference's. Qwen3.5 (a
hybrid Gated DeltaNet text model, loaded with its tower) the same at Ulysses 2 (Qwen3.5-MoE at one rank:
tests/unit/test_qwen3_5_vision.py).
"""

from __future__ import annotations

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS, LR, METRICS
from tiny_vl import vl_rows, write_tiny_vl
from tolerances import assert_adam_step_close, assert_grads_close, assert_scalars_close, model_rtol

from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.models.loading import load_causal_lm
from rlsp.models.vision_lm import VisionLogprobModel
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed

P, R = 22, 6
GRIDS = [[], [[1, 4, 4]], [[1, 2, 4], [1, 4, 6]], [[1, 4, 2]], [], [[1, 2, 2]]]
TOKENS = len(GRIDS) * (P + R)


def _train_once(rank: int, world: int, path: str, ulysses: int, ring: int, batch, freeze: bool = False):
    dims = layout_dims(ulysses=ulysses, ring=ring)
    module = VisionLogprobModel(load_causal_lm(path, dtype=torch.float32, vision_tower=True), freeze_vision_tower=freeze)
    engine = FSDPEngine(module, dims, torch.device("cpu"), optim=OptimSettings(lr=LR, grad_clip=0.0))
    loss_fn = make_actor_loss(LOSS, *global_counts(batch, dims.dp_group))
    engine.optimizer.zero_grad(set_to_none=True)
    metrics = engine.backward_batch(batch, P, 3, loss_fn, None, temperature=1.0, with_entropy=True)
    grads = {k: v.clone() for k, v in engine.iter_full_grads()}
    tower = {k: v.clone() for k, v in engine.iter_full_params() if k.startswith("model.visual.")}
    engine.optimizer.step()
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    if freeze:  # the tower keeps its weights
        assert all(torch.equal(params[k], v) for k, v in tower.items()) and tower
    return (metrics, grads, params) if rank == 0 else None


def _bounds(path: str) -> tuple[float, float, float]:
    """(metric rtol, gradient rtol, metric scale): model_rtol over the text layers and the tower's blocks."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return model_rtol(config, TOKENS, backward=False), model_rtol(config, TOKENS), float(torch.tensor(64.0).log())


@pytest.fixture(scope="module")
def vl_model_and_batch(request, tmp_path_factory):
    path = write_tiny_vl(request.param, str(tmp_path_factory.mktemp(request.param)))
    batch = vl_rows(GRIDS, P, R)
    return path, batch, run_distributed(_train_once, 1, path, 1, 1, batch)[0]


# Qwen3-VL at every layout; Qwen2.5-VL (its windowed tower and rope) at the uneven Ulysses 4; Qwen3-VL-MoE and Qwen3.5
# (Gated DeltaNet layers: no ring) at Ulysses 2
@pytest.mark.parametrize("vl_model_and_batch,world,ulysses,ring", [
    ("qwen3_vl", 2, 2, 1), ("qwen3_vl", 4, 4, 1), ("qwen3_vl", 2, 1, 2), ("qwen3_vl", 4, 2, 2),
    ("qwen2_5_vl", 4, 4, 1), ("qwen3_vl_moe", 2, 2, 1), ("qwen3_5", 2, 2, 1)],
    indirect=["vl_model_and_batch"])
def test_vision_language_loss_gradients_and_step_exact(vl_model_and_batch, world, ulysses, ring):
    path, batch, ref = vl_model_and_batch
    metrics, grads, params = run_distributed(_train_once, world, path, ulysses, ring, batch)[0]
    ref_metrics, ref_grads, ref_params = ref
    assert any(k.startswith("model.visual.") for k in ref_grads)  # the tower trains
    metric_rtol, grad_rtol, scale = _bounds(path)
    assert_scalars_close(metrics, ref_metrics, METRICS, metric_rtol, scale)
    assert_grads_close(grads, ref_grads, grad_rtol)
    assert_adam_step_close(params, ref_params, grads, ref_grads, LR)


@pytest.mark.parametrize("vl_model_and_batch", ["qwen3_vl"], indirect=True)
def test_frozen_vision_tower_at_ulysses_2(vl_model_and_batch):
    """freeze_vision_tower: no tower gradient or step anywhere; the text model's gradients and step are the trained
    tower's reference's (the tower's weights are the same in both forwards)."""
    path, batch, ref = vl_model_and_batch
    metrics, grads, params = run_distributed(_train_once, 2, path, 2, 1, batch, True)[0]
    ref_metrics, ref_grads, ref_params = ref
    ref_grads = {k: v for k, v in ref_grads.items() if not k.startswith("model.visual.")}
    assert grads.keys() == ref_grads.keys()
    metric_rtol, grad_rtol, scale = _bounds(path)
    assert_scalars_close(metrics, ref_metrics, METRICS, metric_rtol, scale)
    assert_grads_close(grads, ref_grads, grad_rtol)
    text = [k for k in params if not k.startswith("model.visual.")]
    assert_adam_step_close({k: params[k] for k in text}, {k: ref_params[k] for k in text}, grads, ref_grads, LR)
