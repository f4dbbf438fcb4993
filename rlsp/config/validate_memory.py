"""Start-up checks of the memory-saving model options: tiled MLP, lean RMSNorm and activation offload.

`actor_rollout_ref.model.*` applies to the actor and the reference, `critic.model.*` to the critic.
Called by `rlsp.config.validate.validate_config` with the roles' layout; appends to its error list.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.layout import ParallelLayout, RoleLayout


def _check_tiled_mlp(prefix: str, model: Any, roles: dict[str, RoleLayout], errors: list[str]) -> None:
    tiled = model.tiled_mlp
    n = tiled.num_shards
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        errors.append(f"{prefix}tiled_mlp.num_shards={n!r} must be an integer >= 1 (tiles per MLP call; legal "
                      "values: 1, 2, 3, ...; default 4)")
    if not tiled.enabled:
        return
    for key, layout in roles.items():
        if layout.tp > 1:
            errors.append(
                f"{prefix}tiled_mlp.enabled=true does not combine with {key}.tensor_model_parallel_size={layout.tp}: "
                "the row-parallel down projection would reduce (with sequence_parallel: reduce-scatter) every "
                "tile over the tp group on its own, and tp already divides the MLP activations by tp; legal: "
                f"{prefix}tiled_mlp.enabled=false, or tensor_model_parallel_size=1"
            )


def _check_lean_rmsnorm(prefix: str, model: Any, errors: list[str]) -> None:
    lean = model.lean_rmsnorm
    if not isinstance(lean, bool):
        errors.append(f"{prefix}lean_rmsnorm={lean!r} must be true or false")


def _check_offload(prefix: str, model: Any, errors: list[str]) -> None:
    if model.enable_activation_offload and not model.enable_gradient_checkpointing:
        errors.append(
            f"{prefix}enable_activation_offload=true needs {prefix}enable_gradient_checkpointing=true (it is "
            "false): without checkpointing every tensor each layer saves for backward (attention and MLP "
            "intermediates) would be copied to host memory and back every micro-batch, with it only each "
            "layer's input is; legal: enable both, or neither"
        )


def check_memory_options(cfg: Any, layout: ParallelLayout, errors: list[str]) -> None:
    """Tiled MLP (num_shards >= 1, no tensor parallelism), lean RMSNorm (a bool) and
    activation offload (with checkpointing)."""
    arr = cfg.actor_rollout_ref
    policy = {"actor_rollout_ref.actor": layout.actor, "actor_rollout_ref.ref": layout.ref}
    _check_tiled_mlp("actor_rollout_ref.model.", arr.model, policy, errors)
    _check_offload("actor_rollout_ref.model.", arr.model, errors)
    _check_lean_rmsnorm("actor_rollout_ref.model.", arr.model, errors)
    if layout.critic is not None:
        _check_tiled_mlp("critic.model.", cfg.critic.model, {"critic": layout.critic}, errors)
        _check_offload("critic.model.", cfg.critic.model, errors)
        _check_lean_rmsnorm("critic.model.", cfg.critic.model, errors)
