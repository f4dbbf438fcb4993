"""LoRA on a vision-language model's language model (rlsp.models.vision_lora) under Ulysses, element by element.

A tiny Qwen2.5-VL with tied embeddings (tests/tiny_vl.py; Qwen2.5-VL 3B's convention) gets LoRA adapters as the actor
builds them (all-linear: the language model's 14 linear layers, none in the vision tower or the merger), B drawn at
random (peft starts it at zero, which would make adapters on and off the same function), and trains on
tests/distributed/test_vision_exact.py's rows (0, 1 and 2 images per row, two micro-batches of 3 rows):
* Ulysses 2 equals one process: logprobs with the adapters on and off, the loss metrics, every adapter gradient
  (nothing else gets one: the tower is frozen) and the AdamW step, within tests/tolerances.py's bounds;
* the reference (adapters off) equals a frozen engine of the base model;
* the merged weights the sync sends after the step (base names, the tied output layer) are taken by the hf rollout
  engine, whose logprobs then equal the actor's;
* the checkpoint holds the adapters (and their optimizer state) only and reloads bit-exactly on one rank; the export
  writes the PEFT adapter (no tower layer) and a merged vision-language model whose logprobs equal the actor's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS, LR, METRICS
from test_vision_exact import GRIDS, TOKENS, P, R
from tiny_vl import hf_row_logprobs, vl_rows, write_tiny_vl
from tolerances import (
    assert_adam_step_close,
    assert_grads_close,
    assert_scalars_close,
    assert_tensor_close,
    decoder_chain,
    logprob_tol,
    model_rtol,
)

from rlsp.engine.checkpoint import load_engine, save_engine
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.models.loading import load_causal_lm
from rlsp.models.lora import LORA_ADAPTER_DIR, LoraSettings, apply_lora, is_adapter_param
from rlsp.models.vision_lm import VisionLogprobModel
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed

LORA = LoraSettings(rank=4, alpha=8.0)
ADAPTED = 14  # 2 text layers x (q, k, v, o, gate, up, down)


def _lora_engine(path: str, dims, b_seed: int = 0):
    lm = load_causal_lm(path, dtype=torch.float32)
    adapters = apply_lora(lm, LORA)
    g = torch.Generator().manual_seed(b_seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    engine = FSDPEngine(VisionLogprobModel(lm), dims, torch.device("cpu"), optim=OptimSettings(lr=LR, grad_clip=0.0))
    return engine, adapters


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def _train(rank: int, world: int, path: str, batch, ckpt: str | None):
    """One LoRA step at Ulysses `world`; with `ckpt` also the frozen base's logprobs, the merged sync weights and a
    checkpoint of the step."""
    engine, adapters = _lora_engine(path, layout_dims(ulysses=world))
    infer = lambda e: e.infer(batch, P, 3, "logprobs", temperature=1.0)  # noqa: E731
    with adapters.adapters_disabled():
        out = {"base_lp": infer(engine)}
    out["lp"] = infer(engine)
    engine.optimizer.zero_grad(set_to_none=True)
    loss_fn = make_actor_loss(LOSS, *global_counts(batch, engine.dims.dp_group))
    out["metrics"] = engine.backward_batch(batch, P, 3, loss_fn, None, temperature=1.0, with_entropy=True)
    out["grads"] = {k: v.clone() for k, v in engine.iter_full_grads()}
    engine.optimizer.step()
    out["params"] = {k: v.clone() for k, v in engine.iter_full_params() if is_adapter_param(k)}
    if ckpt is not None:
        frozen = FSDPEngine(VisionLogprobModel(load_causal_lm(path)), engine.dims, torch.device("cpu"))
        out["frozen_lp"] = infer(frozen)
        out["merged"] = [(n, t.clone()) for n, t in adapters.merge_for_rollout(engine.iter_full_params())]
        out["after_lp"] = infer(engine)
        save_engine(engine, os.path.join(ckpt, "actor"))
        out["saved"] = {k: _whole(v) for k, v in engine.state_dict()["model"].items()}
        if rank == 0:  # what ActorRole._save_hf_assets writes beside the sharded state
            assets = os.path.join(ckpt, "actor", "huggingface")
            engine.hf_root.config.save_pretrained(assets)
            adapters.save_config(os.path.join(assets, LORA_ADAPTER_DIR), base_model=path)
    return out if rank == 0 else None


def _load(rank: int, world: int, path: str, ckpt: str):
    engine, _ = _lora_engine(path, layout_dims(ulysses=world), b_seed=7)  # another init: the load must replace it
    load_engine(engine, os.path.join(ckpt, "actor"))
    return {k: _whole(v) for k, v in engine.state_dict()["model"].items()} if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(model dir, rows, checkpoint dir, one process's step, Ulysses 2's step with its extras)."""
    from rlsp.models.tokenizer import build_char_tokenizer

    path = write_tiny_vl("qwen2_5_vl", str(tmp_path_factory.mktemp("qwen2_5_vl")), tie_word_embeddings=True)
    build_char_tokenizer().save_pretrained(path)  # the hf engine and the export read it
    batch, ckpt = vl_rows(GRIDS, P, R), str(tmp_path_factory.mktemp("vl_lora_ckpt"))
    one = run_distributed(_train, 1, path, batch, None)[0]
    two = run_distributed(_train, 2, path, batch, ckpt)[0]
    return path, batch, ckpt, one, two


def _bounds(path: str) -> tuple[float, float, float]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return model_rtol(config, TOKENS, backward=False), model_rtol(config, TOKENS), float(torch.tensor(64.0).log())


def test_ulysses_2_equals_one_process(runs):
    path, _, _, ref, got = runs
    rtol, grad_rtol, scale = _bounds(path)
    assert float((ref["lp"] - ref["base_lp"]).abs().max()) > 1e-3  # the adapters matter on these rows
    assert_tensor_close(got["lp"], ref["lp"], rtol, scale)
    assert_tensor_close(got["base_lp"], ref["base_lp"], rtol, scale)
    assert_scalars_close(got["metrics"], ref["metrics"], METRICS, rtol, scale)
    grads = got["grads"]
    assert grads.keys() == ref["grads"].keys() and len(grads) == 2 * ADAPTED
    assert all(is_adapter_param(k) and k.startswith("model.language_model.") for k in grads)
    assert_grads_close(grads, ref["grads"], grad_rtol)
    assert_adam_step_close(got["params"], ref["params"], grads, ref["grads"], LR)


def test_reference_with_adapters_off_equals_the_base_model(runs):
    path, _, _, _, got = runs
    rtol, _, scale = _bounds(path)
    assert_tensor_close(got["base_lp"], got["frozen_lp"], rtol, scale)


def _gap(model, batch, actor_BR: torch.Tensor) -> float:
    mask_BR = batch["response_mask"].bool()
    with torch.no_grad():
        return float((hf_row_logprobs(model, batch)[:, P - 1:] - actor_BR)[mask_BR].abs().max())


def _tol(path: str, batch, actor_BR: torch.Tensor) -> float:
    from transformers import AutoConfig

    scale = float(actor_BR[batch["response_mask"].bool()].abs().max())
    return logprob_tol(decoder_chain(AutoConfig.from_pretrained(path)), TOKENS, value_scale=scale)


def test_merged_weights_reach_the_hf_rollout_engine(runs):
    from rlsp.rollout.hf_engine import HFEngine

    path, batch, _, _, got = runs
    names = [n for n, _ in got["merged"]]
    assert not any("lora_" in n or "base_layer" in n for n in names) and "lm_head.weight" in names
    engine = HFEngine(path)
    before = _gap(engine.model, batch, got["after_lp"])
    engine.update_weights(got["merged"])  # unknown names raise
    tol = _tol(path, batch, got["after_lp"])
    assert _gap(engine.model, batch, got["after_lp"]) <= tol < before / 100


def test_checkpoint_holds_adapters_reloads_and_exports(runs, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from rlsp.engine.export import export_hf

    path, batch, ckpt, _, got = runs
    saved = got["saved"]
    assert len(saved) == 2 * ADAPTED and all(is_adapter_param(k) for k in saved)
    loaded = run_distributed(_load, 1, path, ckpt)[0]
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    out = export_hf(ckpt, str(tmp_path / "hf"))
    adapter_dir = os.path.join(out, LORA_ADAPTER_DIR)
    with safe_open(os.path.join(adapter_dir, "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert len(keys) == 2 * ADAPTED and not any("visual" in k for k in keys)
    assert "model\\.visual" in json.load(open(os.path.join(adapter_dir, "adapter_config.json")))["exclude_modules"]
    merged = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    tol = _tol(path, batch, got["after_lp"])
    assert _gap(merged, batch, got["after_lp"]) <= tol
    peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32),
                                     adapter_dir).eval()
    assert _gap(peft, batch, got["after_lp"]) <= tol
