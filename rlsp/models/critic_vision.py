"""Which model the critic loads, with or without a vision tower, and what rlsp refuses for a vision-language critic.

The critic starts from `critic.model.path`, or from the actor's model when unset (`critic_model_path`). It loads with
its vision tower (`critic_vision_tower`; rlsp.models.value.VisionValueModel, the policy's image path) when that model
is a vision-language family (qwen2_5_vl, qwen3_vl, qwen3_vl_moe), or a Qwen3.5 wrapper (qwen3_5, qwen3_5_moe) while
the run's rows carry images (decided from the same data files as the policy's tower: rlsp.data.vision_run). A text
critic on rows with images is given the rows without their images (the image placeholders are tokens to it).

`critic_vision_errors` names, by key, what is not verified with the tower (the `model` preflight check runs it):
tensor parallelism, tiled MLP and lean RMSNorm on a critic that loads a tower (the actor's keys are refused the same
way), a critic model of its own whose image geometry differs from the actor's (the rows' pixel values come from the
actor's processor), and `critic.model.freeze_vision_tower=true` on a critic without a tower. No torch.
"""

from __future__ import annotations

import json
import os
from typing import Any

from rlsp.config.model_shape import TEXT_WRAPPERS
from rlsp.data.vision_processor import image_rows
from rlsp.data.vision_run import IMAGE_COLUMN, data_files, model_type_of, policy_vision_tower
from rlsp.models.vision_inputs import VISION_FAMILIES

# What the rows' images must agree on between the actor's model (whose processor made them) and the critic's.
IMAGE_TOKEN_KEYS = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
IMAGE_GEOMETRY_KEYS = ("patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels", "in_chans")


def critic_model_path(cfg: Any) -> str:
    """The critic's model directory: critic.model.path, or the actor's model when unset."""
    return cfg.critic.model.path or cfg.actor_rollout_ref.model.path


def critic_vision_tower(cfg: Any) -> bool:
    """True when the critic's model loads with its vision tower (see the module docstring)."""
    model_type = model_type_of(critic_model_path(cfg))
    if model_type in VISION_FAMILIES:
        return True
    if model_type not in TEXT_WRAPPERS:
        return False
    if model_type_of(cfg.actor_rollout_ref.model.path) in TEXT_WRAPPERS:
        return policy_vision_tower(cfg)  # the same answer, and the same refusal of unreadable data files
    return any(image_rows(file, IMAGE_COLUMN) for file in data_files(cfg))


def _config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def image_geometry_problem(actor_path: str, critic_path: str) -> str | None:
    """Why the rows' images (made by the actor's processor) do not fit the critic's model, or None."""
    actor, critic = _config(actor_path), _config(critic_path)
    if "vision_config" not in actor:
        return None  # a text actor: its rows carry no images
    differ = [f"{k}: {actor.get(k)} vs {critic.get(k)}" for k in IMAGE_TOKEN_KEYS if actor.get(k) != critic.get(k)]
    if actor.get("model_type") != critic.get("model_type"):
        differ.insert(0, f"model_type: {actor.get('model_type')} vs {critic.get('model_type')}")
    va, vc = actor.get("vision_config") or {}, critic.get("vision_config") or {}
    differ += [f"vision_config.{k}: {va.get(k)} vs {vc.get(k)}" for k in IMAGE_GEOMETRY_KEYS if va.get(k) != vc.get(k)]
    if not differ:
        return None
    return (f"critic.model.path={critic_path!r}: its vision-language model does not read the actor's image inputs "
            f"({'; '.join(differ)}: actor vs critic); legal: a critic of the actor's family with the same image "
            "tokens and patch geometry, or leave critic.model.path unset (the critic starts from the actor's model)")


def critic_vision_errors(cfg: Any) -> list[str]:
    """What rlsp refuses for the critic's vision tower under `cfg` (a run with a critic), each naming its key."""
    c = cfg.critic
    try:
        tower = critic_vision_tower(cfg)
    except RuntimeError:  # unreadable data files: the data_files check names them
        return []
    path = critic_model_path(cfg)
    if not tower:
        if c.model.freeze_vision_tower:
            return [f"critic.model.freeze_vision_tower=true: the critic's model {path!r} ({model_type_of(path)}) loads "
                    "without a vision tower; legal: false (a vision-language critic: qwen2_5_vl, qwen3_vl, "
                    "qwen3_vl_moe, or qwen3_5 / qwen3_5_moe on rows with images)"]
        return []
    where = (f"the critic's model {path!r} ({model_type_of(path)}) loads with its vision tower, which rlsp has not "
             "verified with this feature")
    errors = []
    if c.model.path:  # the actor's model is checked by the actor's keys and the layout's degree checks
        if c.tensor_model_parallel_size > 1:
            errors.append(f"critic.tensor_model_parallel_size={c.tensor_model_parallel_size}: {where}; legal: 1 (use "
                          "Ulysses / ring sequence parallelism)")
        if problem := image_geometry_problem(cfg.actor_rollout_ref.model.path, c.model.path):
            errors.append(problem)
    for key, enabled in (("tiled_mlp.enabled=true", c.model.tiled_mlp.enabled),
                         ("lean_rmsnorm=true", c.model.lean_rmsnorm)):
        if enabled:
            errors.append(f"critic.model.{key}: {where}; legal: leave it off for this model")
    return errors
