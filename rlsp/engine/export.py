"""Export the actor of a checkpoint as a Hugging Face model directory (weights, config, tokenizer).

Runs in one process without a process group: the sharded DCP state is read once into an unsharded
model, so full weights exist on this process only. The end-of-run export (`actor_hf/`) uses this
same code on the run's last checkpoint. CLI: `python -m rlsp.export <checkpoint_dir> <out_dir>`.
"""

from __future__ import annotations

import os
import shutil

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlsp.engine.checkpoint import load_model_offline
from rlsp.models.lm import TokenLogprobModel


def export_hf(ckpt_dir: str, out_dir: str) -> str:
    """Write the actor of `ckpt_dir` (a global_step_<N> directory) to `out_dir`; returns `out_dir`."""
    actor = os.path.join(ckpt_dir, "actor")
    assets = os.path.join(actor, "huggingface")
    if not os.path.exists(os.path.join(actor, ".metadata")) or not os.path.isdir(assets):
        raise ValueError(f"{ckpt_dir!r} holds no actor checkpoint (expected {actor}/.metadata and {assets}/); "
                         "pass a global_step_<N> directory written by rlsp")
    config = AutoConfig.from_pretrained(assets)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm = lm.to_empty(device="cpu")
    if getattr(config, "tie_word_embeddings", False):
        lm.tie_weights()
    module = TokenLogprobModel(lm)
    load_model_offline(module, actor)
    staging = f"{out_dir.rstrip(os.sep)}.tmp-export"
    shutil.rmtree(staging, ignore_errors=True)
    lm.save_pretrained(staging, safe_serialization=True)
    for name in os.listdir(assets):  # tokenizer and generation config, as the checkpoint recorded them
        if name not in ("config.json",) and not os.path.exists(os.path.join(staging, name)):
            src = os.path.join(assets, name)
            (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(staging, name))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(staging, out_dir)
    return out_dir
