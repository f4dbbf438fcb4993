"""Preflight checks of the model against the run: the layout's degrees against the model's heads and experts,
rows with images against the model (vision-language checkpoints trained text-only refuse them), and the MoE
settings (routing replay, the router auxiliary loss). Plain functions; rlsp.trainer.preflight registers them in
run order.
"""

from __future__ import annotations

import json
import os
from typing import Any

from omegaconf import DictConfig

from rlsp.config.checks import CheckContext
from rlsp.config.layout import ParallelLayout
from rlsp.config.model_shape import TEXT_WRAPPERS
from rlsp.config.run_spec import agent_loops_enabled
from rlsp.data.vision_processor import image_rows, image_run_errors, vision_data_errors
from rlsp.engine.router_aux import router_aux_errors, with_overrides
from rlsp.engine.router_replay import replay_config_errors
from rlsp.models.family_checks import check_ring_support, check_sp_support, check_tp_windowed
from rlsp.parallel.ep_checks import check_ep_support
from rlsp.parallel.tp_checks import check_tp_support
from rlsp.rollout.support import rollout_ep_errors


def degree_errors(config: Any, layout: ParallelLayout, errors: list[str]) -> None:
    """Every training role's Ulysses and tensor-parallel degrees must suit the model's heads, its expert-parallel
    degree the model's experts."""
    prefixes = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "critic": "critic"}
    for role, prefix in prefixes.items():
        if role == "critic" and not layout.has_critic:
            continue
        degrees = layout.role(role)
        for check, key, value in ((check_sp_support, "ulysses_sequence_parallel_size", degrees.ulysses),
                                  (check_ring_support, "ring_sequence_parallel_size", degrees.ring),
                                  (check_tp_windowed, "tensor_model_parallel_size", degrees.tp),
                                  (check_tp_support, "tensor_model_parallel_size", degrees.tp),
                                  (check_ep_support, f"{'model.' if role == 'critic' else ''}fsdp_config."
                                                     "expert_parallel_size", degrees.ep)):
            try:
                check(config, value)
            except ValueError as exc:
                errors.append(f"{prefix}.{key}: {exc}")


def check_text_only_data(cfg: DictConfig, errors: list[str]) -> None:
    """A vision-language checkpoint rlsp trains text-only (qwen3_5 / qwen3_5_moe): rows with images or videos would
    be trained on their text alone, so they are refused (part of the `model` check)."""
    import pyarrow.parquet as pq  # noqa: PLC0415 -- only this check reads columns

    path = cfg.actor_rollout_ref.model.path
    with open(os.path.join(path, "config.json")) as f:
        family = json.load(f).get("model_type")
    if family not in TEXT_WRAPPERS:
        return
    for file in list(cfg.data.train_files) + list(cfg.data.val_files or []):
        names = pq.ParquetFile(file).schema_arrow.names if file.endswith(".parquet") and os.path.isfile(file) else []
        for key, column in (("data.image_key", "images"), ("data.video_key", "videos")):
            if column in names and any(v is not None and len(v) for v in pq.read_table(file, columns=[column])
                                       .column(column).to_pylist()):
                errors.append(f"{key}={column!r}: rows of {file!r} carry {column}, and actor_rollout_ref.model.path="
                              f"{path!r} is a {family} (vision-language) checkpoint that rlsp trains text-only (its "
                              "text model: the trainer, the hf rollout engine and the export load it without its tower; "
                              "rlsp.models.vision_lm trains it with images only when loaded with load_causal_lm(..., "
                              "vision_tower=True); images are read for qwen2_5_vl, qwen3_vl and qwen3_vl_moe); "
                              "legal: a dataset without "
                              f"{column} in its rows")


def check_vision_data(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """Rows with images need a vision-language model with its processor; videos need torchvision
    (rlsp.data.vision_processor). Qwen3.5 wrappers, trained text-only, are `check_text_only_data`'s."""
    path = cfg.actor_rollout_ref.model.path
    with open(os.path.join(path, "config.json")) as f:
        if json.load(f).get("model_type") in TEXT_WRAPPERS:
            return
    files = list(cfg.data.train_files) + list(cfg.data.val_files or [])
    errors += vision_data_errors("actor_rollout_ref.model.path", path, files)
    if any(image_rows(file, "images") for file in files):
        errors += image_run_errors(cfg)


def check_router_replay(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """MoE routing replay R2 / R3 (verl's rollout switch included) where rlsp can run it (rlsp.engine.router_replay)."""
    errors += replay_config_errors(cfg.actor_rollout_ref, ctx.results["model_config"], agent_loops_enabled(cfg),
                                   bool(cfg.async_training.partial_rollout))


def check_router_aux(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """The MoE router auxiliary loss the model config asks for, model.override_config applied (rlsp.engine.router_aux)."""
    config = with_overrides(ctx.results["model_config"], cfg.actor_rollout_ref.model.override_config)
    errors += router_aux_errors(config, ctx.layout.role("actor") if ctx.layout is not None else None)


def check_rollout_ep(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    """The rollout engine's expert parallelism against the engine, the model and the device (rlsp.rollout.support)."""
    tp = ctx.layout.rollout_tp if ctx.layout is not None else 1
    errors += rollout_ep_errors(ctx.results["model_config"], cfg.actor_rollout_ref.rollout, ctx.device_type, tp)
