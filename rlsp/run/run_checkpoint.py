"""A run's checkpoint on the workers' side and the driver's: every role's sharded state and each worker's
RNG state, then the driver's state (TrainerState, metrics so far, the resolved config), made visible
atomically by the CheckpointWriter (rlsp.run.checkpoint); loading reads them back in the same order."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from rlsp.config.schema_verl_runtime import HF_MODEL
from rlsp.controller.worker_group import RayWorkerGroup
from rlsp.engine.export import export_hf
from rlsp.run.checkpoint import CheckpointWriter, TrainerState


def save_run(ckpt: CheckpointWriter, cfg: DictConfig, state: TrainerState, metrics_lines: list[str],
             wg: RayWorkerGroup, critic_wg: RayWorkerGroup | None, groups: list[RayWorkerGroup]) -> str:
    """Step `state.step`'s checkpoint: the actor (on `wg`) and critic, every group's worker RNGs, the driver's
    state; with verl's hf_model save content also the actor in HF format. Returns its directory."""
    tmp = ckpt.begin(state.step)
    wg.call("actor", "save_checkpoint", tmp)
    if critic_wg is not None:
        critic_wg.call("critic", "save_checkpoint", tmp)
    for group in groups:
        group.call_worker("save_rng", tmp)
    path = ckpt.commit(tmp, state.step, state, metrics_lines, OmegaConf.to_yaml(cfg, resolve=True))
    if HF_MODEL in cfg.actor_rollout_ref.actor.checkpoint.save_contents:  # verl's HF copy per checkpoint
        export_hf(path, os.path.join(path, "actor_hf"))
    return path


def load_run(path: str, wg: RayWorkerGroup, critic_wg: RayWorkerGroup | None, groups: list[RayWorkerGroup]
             ) -> tuple[TrainerState, bool]:
    """Load the roles' states of checkpoint `path` (resharded if the layout changed) and the workers' RNGs:
    (the driver's state, whether every worker's RNG state was restored rather than reseeded)."""
    state = TrainerState.read(path)
    wg.call("actor", "load_checkpoint", path)
    if critic_wg is not None:
        critic_wg.call("critic", "load_checkpoint", path)
    restored = [all(group.call_worker("load_rng", path)) for group in groups]
    return state, all(restored)
