"""Export the actor of a checkpoint as a Hugging Face model directory (weights, config, tokenizer).

A LoRA checkpoint (adapters only, see FSDPEngine.state_dict) is rebuilt on the base model its
adapter config names: the export then holds the merged model (base + scale * B @ A, a plain HF model)
and, under `lora_adapter/`, the PEFT adapter itself (adapter_config.json + adapter_model.safetensors,
loadable with `PeftModel.from_pretrained` on the base).

Runs in one process without a process group: the sharded DCP state is read once into an unsharded
model, so full weights exist on this process only. The end-of-run export (`actor_hf/`) uses this
same code on the run's last checkpoint. CLI: `python -m rlsp.export <checkpoint_dir> <out_dir>`.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from rlsp.engine.checkpoint import load_model_offline
from rlsp.models.lora import LORA_ADAPTER_DIR, apply_saved_lora_config
from rlsp.models.vision_inputs import TOWER_FAMILIES
from rlsp.models.vision_lm import build_logprob_model


def export_hf(ckpt_dir: str, out_dir: str) -> str:
    """Write the actor of `ckpt_dir` (a global_step_<N> directory) to `out_dir`; returns `out_dir`."""
    actor = os.path.join(ckpt_dir, "actor")
    assets = os.path.join(actor, "huggingface")
    if not os.path.exists(os.path.join(actor, ".metadata")) or not os.path.isdir(assets):
        raise ValueError(f"{ckpt_dir!r} holds no actor checkpoint (expected {actor}/.metadata and {assets}/); "
                         "pass a global_step_<N> directory written by rlsp")
    staging = f"{out_dir.rstrip(os.sep)}.tmp-export"
    shutil.rmtree(staging, ignore_errors=True)
    adapter = os.path.join(assets, LORA_ADAPTER_DIR)
    lm = _merged_lora(actor, adapter, staging) if os.path.isdir(adapter) else _full_model(actor, assets)
    lm.save_pretrained(staging, safe_serialization=True)
    for name in os.listdir(assets):  # tokenizer and generation config, as the checkpoint recorded them
        if name not in ("config.json",) and not os.path.exists(os.path.join(staging, name)):
            src = os.path.join(assets, name)
            (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(staging, name))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(staging, out_dir)
    return out_dir


def _full_model(actor: str, assets: str) -> nn.Module:
    """The causal LM with every weight from the checkpoint (full fine-tuning)."""
    config = AutoConfig.from_pretrained(assets)
    # the config the actor saved: a Qwen3.5 wrapper trained with its tower keeps model_type qwen3_5(_moe), text-only
    # it is qwen3_5(_moe)_text
    auto = AutoModelForImageTextToText if config.model_type in TOWER_FAMILIES else AutoModelForCausalLM
    with torch.device("meta"):
        lm = auto.from_config(config, dtype=torch.float32)
    lm = lm.to_empty(device="cpu")
    if getattr(config, "tie_word_embeddings", False):
        lm.tie_weights()
    load_model_offline(build_logprob_model(lm), actor)
    return lm


def _merged_lora(actor: str, adapter_dir: str, staging: str) -> nn.Module:
    """A LoRA checkpoint: the base its adapter_config.json names, with the checkpoint's adapters. Writes
    the PEFT adapter to <staging>/lora_adapter and returns the merged model (W + scale * B @ A)."""
    from peft import PeftConfig  # noqa: PLC0415 -- only LoRA exports need peft

    base_path = PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    if not base_path or not os.path.isdir(base_path):
        raise ValueError(f"the LoRA checkpoint's base model {base_path!r} (adapter_config.json in {adapter_dir}) is "
                         "not a directory here; the adapter needs the base it was trained on")
    # the class the checkpoint recorded: a vision-language model (a Qwen3.5 wrapper trained with images) with its tower
    recorded = AutoConfig.from_pretrained(os.path.dirname(adapter_dir)).model_type
    auto = AutoModelForImageTextToText if recorded in TOWER_FAMILIES else AutoModelForCausalLM
    lm = auto.from_pretrained(base_path, dtype=torch.float32)
    adapters = apply_saved_lora_config(lm, adapter_dir)
    load_model_offline(build_logprob_model(lm), actor, trainable_only=True)
    adapters.peft_model.save_pretrained(os.path.join(staging, LORA_ADAPTER_DIR))
    return adapters.merged_lm()
