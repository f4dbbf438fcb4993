"""Whether a run's policy model loads with its vision tower, decided from the model directory and the run's data.

Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE always load with their tower (rlsp.models.loading). A Qwen3.5 wrapper checkpoint
(qwen3_5 / qwen3_5_moe, `TEXT_WRAPPERS`) is trained as its text model unless the run reads rows with images: then the
actor, the reference and the hf rollout engine all load it with its tower (rlsp.models.vision_lm, rlsp.rollout.hf_vision),
and its checkpoints and export hold the tower too. Every process decides the same way from the same resolved
config: the driver's preflight, and each worker before it builds its models.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from rlsp.config.model_shape import TEXT_WRAPPERS
from rlsp.data.vision_processor import image_rows

IMAGE_COLUMN = "images"  # verl's image column, the one rlsp.data.multimodal renders


def model_type_of(path: str) -> str | None:
    """The model_type of the config.json in `path` (None when there is none)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f).get("model_type")


def data_files(cfg: Any) -> list[str]:
    """The run's train and validation files (resolved paths)."""
    return list(cfg.data.train_files) + list(cfg.data.val_files or [])


def policy_vision_tower(cfg: Any) -> bool:
    """True when the run's policy model is a Qwen3.5 wrapper (qwen3_5 / qwen3_5_moe) and its train or validation
    rows carry images: the actor, the reference and the hf rollout engine then load it with its vision tower. False
    for every other model (vision-language families always load with theirs; text models have none)."""
    if model_type_of(cfg.actor_rollout_ref.model.path) not in TEXT_WRAPPERS:
        return False
    files = data_files(cfg)
    missing = [f for f in files if f.endswith(".parquet") and not os.path.isfile(f)]
    if missing:  # a worker on another node without the data would load the text model and then meet images
        raise RuntimeError(f"data files {missing} are not readable here: a {model_type_of(cfg.actor_rollout_ref.model.path)} "
                           "policy loads with its vision tower when the data's rows carry images, which every worker "
                           "reads from the data files; legal: data files at the same path on every node")
    return _any_images(tuple((f, os.path.getmtime(f) if os.path.isfile(f) else 0.0) for f in files))


@functools.lru_cache(maxsize=8)
def _any_images(files: tuple[tuple[str, float], ...]) -> bool:
    """Whether any of `files` (path, mtime) has a row with images: read once per process (the actor, the reference
    and the rollout engine of a worker ask the same question)."""
    return any(image_rows(f, IMAGE_COLUMN) for f, _ in files)


def tower_switch_problem(cfg: Any, checkpoint_model_dir: str) -> str | None:
    """Why a checkpoint whose actor model config lies in `checkpoint_model_dir` cannot resume under `cfg` because
    one of the two holds the Qwen3.5 vision tower and the other does not (None when both agree or neither is a
    Qwen3.5 wrapper). The checkpoint records model_type qwen3_5 / qwen3_5_moe with its tower, the text type without."""
    saved = model_type_of(checkpoint_model_dir)
    wrappers = {**{w: True for w in TEXT_WRAPPERS}, **{t: False for t in TEXT_WRAPPERS.values()}}
    if saved not in wrappers or model_type_of(cfg.actor_rollout_ref.model.path) not in TEXT_WRAPPERS:
        return None
    had, has = wrappers[saved], policy_vision_tower(cfg)
    if had == has:
        return None
    return (f"its actor was trained {'with' if had else 'without'} the vision tower (its model_type {saved!r}); this "
            f"command's data {'has' if has else 'has no'} rows with images (data.{IMAGE_COLUMN}), so the policy loads "
            f"{'with' if has else 'without'} it and the saved weights do not load; legal: resume with data "
            f"{'with' if had else 'without'} images, or export the checkpoint (python -m rlsp.export) and start a new run "
            "from it")
