"""Entry point: `python -m rlsp.main [hydra overrides]`.

With no arguments it runs the tiny CPU GRPO demo (built-in tiny Qwen2 + arithmetic task) on an
embedded local Ray with 2 workers. On a Ray cluster, submit the same command as a job (the driver
joins the cluster through RAY_ADDRESS or trainer.ray_address).
"""

from __future__ import annotations

import os
from typing import Any

import hydra
import ray
from omegaconf import DictConfig, OmegaConf

from rlsp.config.layout import ParallelLayout
from rlsp.config.store import register_schema
from rlsp.config.validate import validate_config
from rlsp.trainer.checkpoint import latest_checkpoint, resolve_resume
from rlsp.trainer.preflight import preflight
from rlsp.trainer.ray_trainer import RayTrainer
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.main")
register_schema()


def _init_ray(cfg: DictConfig, world_size: int) -> None:
    if ray.is_initialized():
        return
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    ray.init(num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False, log_to_driver=True,
             object_store_memory=512 * 1024**2)


def run(cfg: DictConfig) -> list[dict[str, Any]]:
    """Validate, resolve assets, start workers, train; returns the per-step metrics."""
    layout = validate_config(cfg)
    cfg = preflight(cfg)
    return train(cfg, layout)


def prepare(cfg: DictConfig, layout: ParallelLayout) -> tuple[RayTrainer, str | None]:
    """Everything that can fail on the user's input, before Ray starts: whether to resume, the datasets."""
    resume = resolve_resume(cfg)
    trainer = RayTrainer(cfg, layout)
    os.makedirs(cfg.trainer.default_local_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(cfg.trainer.default_local_dir, "config.yaml"), resolve=True)
    return trainer, resume


def train(cfg: DictConfig, layout: ParallelLayout, prepared: tuple[RayTrainer, str | None] | None = None
          ) -> list[dict[str, Any]]:
    trainer, resume = prepared or prepare(cfg, layout)
    log.info("run dir: %s | %s", cfg.trainer.default_local_dir, layout.describe())
    _init_ray(cfg, layout.total_workers)
    clean = False
    try:
        trainer.start_workers()
        if resume:
            trainer.load_checkpoint(resume)
        history = trainer.fit()
        clean = True
        return history
    finally:
        # After a fault or Ctrl-C the workers may be stuck in a collective: kill them, don't wait.
        trainer.shutdown(graceful=clean)


@hydra.main(config_path="../configs", config_name="rlsp", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        layout = validate_config(cfg)
        cfg = preflight(cfg)
        prepared = prepare(cfg, layout)
    except ValueError as exc:
        # Config and data errors are for the user, not a traceback; nothing has started yet.
        log.error("%s", exc)
        raise SystemExit(2) from None
    try:
        train(cfg, layout, prepared)
    except KeyboardInterrupt:
        latest = latest_checkpoint(cfg.trainer.default_local_dir)
        where = f"last complete checkpoint: {latest} (continue with the same command)" if latest else "no checkpoint was written"
        log.error("interrupted; %s", where)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
