"""Sharded checkpoints of an engine with torch.distributed.checkpoint (DCP), and offline read-back.

`save_engine` / `load_engine` are collective over the engine's world: every rank writes (reads) the
shards it owns, so a checkpoint never gathers full weights, and DCP reshards on load — a checkpoint
written by 2 ranks loads on 1 (or on 4, or with another sp size). `load_model_offline` reads only
the model weights into one process without any process group: the export path, where full weights
are materialised exactly once.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn

from rlsp.engine.fsdp_engine import FSDPEngine


def save_engine(engine: FSDPEngine, path: str) -> None:
    """Write model, optimizer and LR-schedule state under `path` (a directory; collective)."""
    dcp.save(engine.state_dict(), checkpoint_id=path)


def load_engine(engine: FSDPEngine, path: str) -> None:
    """Restore what `save_engine` wrote, resharding onto this engine's layout (collective)."""
    state = engine.state_dict()
    dcp.load(state, checkpoint_id=path)
    engine.load_state_dict(state)


def load_model_offline(module: nn.Module, path: str, trainable_only: bool = False) -> None:
    """Fill an unsharded `module` (same class as the engine's) with the checkpoint's model weights,
    in this process only (no process group needed). `trainable_only`: the checkpoint holds only the
    parameters of `module` that require grad (LoRA adapters; the frozen base is the module's own)."""
    state = module.state_dict()
    if trainable_only:
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trainable}
    template: dict[str, Any] = {"model": state}
    with warnings.catch_warnings():  # single-process loading is the point here, not an accident
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=path, no_dist=True)
    module.load_state_dict(template["model"], strict=not trainable_only)
