"""A Qwen3.5 checkpoint trained with its vision tower exports as the vision-language model, processor included.

The tiny qwen3_5 of tests/tiny_vl.py with the tiny processor files (rlsp/models/tiny_vl.py), loaded with its tower
as the actor loads it for rows with images (rlsp.data.vision_run), takes one update at Ulysses 2 on rows with 0, 1 and
2 images and is saved as the actor saves it (sharded model state, the model's config -- still qwen3_5, not its text
config -- tokenizer and processor files). `export_hf` then writes a directory that AutoModelForImageTextToText and
the processor load back: every weight (tower included) equals the trained one, and transformers' forward of each row
with its images gives the trainer's logprobs of its response tokens within tests/tolerances.py's bound.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _launch import layout_dims, run_distributed
from test_fsdp_engine import LOSS
from tiny_vl import build_tiny_vl, hf_row_logprobs, hybrid_vl_config, vl_rows
from tolerances import decoder_chain, logprob_tol
from transformers import AutoModelForImageTextToText, AutoTokenizer

from rlsp.data.vision_processor import PROCESSOR_FILES, load_processor
from rlsp.engine.checkpoint import save_engine
from rlsp.engine.export import export_hf
from rlsp.engine.fsdp_engine import FSDPEngine
from rlsp.engine.optim import OptimSettings
from rlsp.models.loading import load_causal_lm
from rlsp.models.tiny_vl import write_tiny_vl_processor
from rlsp.models.vision_lm import build_logprob_model
from rlsp.workers.actor_loss import make_actor_loss
from rlsp.workers.ppo_loop import global_counts

pytestmark = pytest.mark.distributed

P, R = 22, 6
GRIDS = [[], [[1, 4, 4]], [[1, 2, 4], [1, 4, 6]], [[1, 4, 2]]]


def _train_and_save(rank: int, world: int, path: str, batch, ckpt: str):
    dims = layout_dims(ulysses=2)
    module = build_logprob_model(load_causal_lm(path, dtype=torch.float32, vision_tower=True))
    engine = FSDPEngine(module, dims, torch.device("cpu"), optim=OptimSettings(lr=1e-2, grad_clip=0.0))
    engine.train_step(batch, P, 4, make_actor_loss(LOSS, *global_counts(batch, dims.dp_group)), temperature=1.0,
                      with_entropy=True)
    save_engine(engine, os.path.join(ckpt, "actor"))
    if rank == 0:  # what ActorRole._save_hf_assets writes beside the sharded state
        assets = os.path.join(ckpt, "actor", "huggingface")
        engine.hf_root.config.save_pretrained(assets)  # the model's config, not its text model's (engine.config)
        AutoTokenizer.from_pretrained(path).save_pretrained(assets)
        for name in PROCESSOR_FILES:
            if os.path.exists(os.path.join(path, name)):
                shutil.copy2(os.path.join(path, name), os.path.join(assets, name))
    logprobs = engine.infer(batch, P, 4, "logprobs", temperature=1.0)
    params = {k: v.clone() for k, v in engine.iter_full_params()}
    return (logprobs, params) if rank == 0 else None


def test_export_is_the_vision_language_model_with_the_trainers_logprobs(tmp_path):
    path = write_tiny_vl_processor(str(tmp_path / "model"))
    build_tiny_vl(hybrid_vl_config("qwen3_5")).save_pretrained(path)
    batch, ckpt = vl_rows(GRIDS, P, R), str(tmp_path / "global_step_1")
    logprobs, params = run_distributed(_train_and_save, 2, path, batch, ckpt)[0]
    out = export_hf(ckpt, str(tmp_path / "hf"))
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.model_type == "qwen3_5" and type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    exported = dict(model.named_parameters())
    assert exported.keys() == params.keys() and any(k.startswith("model.visual.") for k in exported)
    assert all(torch.equal(exported[k], params[k]) for k in exported)
    assert load_processor("export", out).image_processor is not None  # the processor files came along
    with torch.no_grad():
        want_BL = hf_row_logprobs(model, batch)
    mask_BR = batch["response_mask"].bool()
    got = logprobs[mask_BR]
    want = want_BL[:, P - 1:][mask_BR]  # column c holds log p(token c + 1): the response starts at column P - 1
    tol = logprob_tol(decoder_chain(model.config), len(GRIDS) * (P + R))
    assert (got - want).abs().max() <= tol, ((got - want).abs().max(), tol)
