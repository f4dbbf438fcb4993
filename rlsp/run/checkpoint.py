"""Run checkpoints: layout on disk, atomic saves, pruning, and choosing what to resume from.

    <default_local_dir>/
      global_step_<N>/
        actor/                 DCP shards: model + optimizer + LR schedule (any layout can load them)
        actor/huggingface/     config, tokenizer, generation config (for export)
        critic/                DCP shards of the critic (PPO)
        rng/<group>_rank<r>_of<world>.pt   every worker's torch RNG state
        trainer_state.json     step, data position, KL controller, the layout it was written with
        metrics.jsonl          the metrics of steps 1..N
        config.yaml            the resolved config of the run that wrote it
      latest_checkpointed_iteration.txt   N of the newest complete checkpoint (written last)

A checkpoint is written into `.tmp_global_step_<N>/` and made visible by one rename; the pointer
file is replaced after that. A run killed at any moment leaves the previous checkpoint and pointer
intact. Pruning (`trainer.max_{actor,critic}_ckpt_to_keep`) removes old model states only after the
new checkpoint is complete. `damaged_file` finds a missing, truncated or unreadable file of a
checkpoint from the DCP metadata and file sizes, without reading any weights. This module imports
torch only inside those checks: the entry point reads `finished_step` before anything heavy is loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


@dataclass
class TrainerState:
    """What the driver needs to continue a run exactly."""

    step: int
    epoch: int
    batch_in_epoch: int  # batches of `epoch` already consumed
    kl_ctrl: dict[str, float]
    layout: str

    @staticmethod
    def read(ckpt_dir: str) -> TrainerState:
        with open(os.path.join(ckpt_dir, STATE)) as f:
            data = json.load(f)
        return TrainerState(**{k: data[k] for k in ("step", "epoch", "batch_in_epoch", "kl_ctrl", "layout")})


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"global_step_{step}")


def complete_steps(run_dir: str) -> list[int]:
    """Steps with a complete checkpoint directory (temporary ones are never listed), ascending."""
    if not os.path.isdir(run_dir):
        return []
    steps = [int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(run_dir)) if m]
    return sorted(s for s in steps if os.path.exists(os.path.join(step_dir(run_dir, s), STATE)))


def latest_checkpoint(run_dir: str) -> str | None:
    """The checkpoint the pointer file names (falling back to the newest complete one)."""
    pointer = os.path.join(run_dir, LATEST)
    if os.path.exists(pointer):
        with open(pointer) as f:
            text = f.read().strip()
        if text.isdigit() and os.path.exists(os.path.join(step_dir(run_dir, int(text)), STATE)):
            return step_dir(run_dir, int(text))
    steps = complete_steps(run_dir)
    return step_dir(run_dir, steps[-1]) if steps else None


def _recorded_steps(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def resolve_resume(cfg: DictConfig) -> str | None:
    """The checkpoint directory to resume from, or None to start fresh; ValueError when neither is
    possible without losing an earlier run's record. Runs in the driver before any worker has the run's config."""
    t = cfg.trainer
    run_dir = t.default_local_dir
    if t.resume_mode == "resume_path":
        path = t.resume_from_path
        if not path or not os.path.exists(os.path.join(path, STATE)):
            raise ValueError(f"trainer.resume_mode=resume_path needs trainer.resume_from_path to be a complete "
                             f"checkpoint directory (global_step_<N> holding {STATE}); got {path!r}")
        return os.path.abspath(path)
    latest = latest_checkpoint(run_dir)
    if t.resume_mode == "auto" and latest is not None:
        return os.path.abspath(latest)
    recorded = _recorded_steps(run_dir)
    if latest is not None or recorded:
        held = f"checkpoint {os.path.basename(latest)}" if latest else f"metrics of {recorded} steps and no checkpoint"
        how = ("use trainer.resume_mode=auto to continue it" if latest else "it cannot be continued")
        raise ValueError(f"trainer.default_local_dir={run_dir!r} already holds a run ({held}); {how}, or choose "
                         "another trainer.default_local_dir — rlsp never overwrites a run in place")
    return None


def finished_step(cfg: DictConfig) -> int | None:
    """The step of the checkpoint this command would continue, when it is at or past
    trainer.total_training_steps (nothing is left to train); else None. Reads trainer_state.json only;
    anything unusual (a refused resume, an unreadable file) is left to the full checks, and so is a run
    length that only the dataset decides (total_training_steps unset: total_epochs x batches)."""
    try:
        path = resolve_resume(cfg)
        step = TrainerState.read(path).step if path else None
    except (ValueError, OSError, KeyError, TypeError):
        return None
    total = cfg.trainer.total_training_steps
    return step if step is not None and total is not None and step >= total else None


class CheckpointWriter:
    """Driver side of a save: temp dir, worker writes, trainer files, rename, pointer, pruning."""

    def __init__(self, run_dir: str, max_actor: int | None, max_critic: int | None) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.max_actor, self.max_critic = max_actor, max_critic

    def begin(self, step: int) -> str:
        tmp = os.path.join(self.run_dir, f".tmp_global_step_{step}")
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that died half-way
        os.makedirs(tmp)
        return tmp

    def commit(self, tmp: str, step: int, state: TrainerState, metrics_lines: list[str], config_yaml: str) -> str:
        _write(os.path.join(tmp, STATE), json.dumps(state.__dict__, indent=2))
        _write(os.path.join(tmp, "metrics.jsonl"), "".join(metrics_lines))
        _write(os.path.join(tmp, "config.yaml"), config_yaml)
        final = step_dir(self.run_dir, step)
        if os.path.exists(final):  # an older save of the same step (a resumed run re-saving it)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_atomic(os.path.join(self.run_dir, LATEST), f"{step}\n")
        self._prune()
        return final

    def _prune(self) -> None:
        steps = complete_steps(self.run_dir)
        for part, keep in (("actor", self.max_actor), ("critic", self.max_critic)):
            if keep is None or keep <= 0:
                continue
            for old in steps[:-keep]:
                shutil.rmtree(os.path.join(step_dir(self.run_dir, old), part), ignore_errors=True)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    _write(tmp, text)
    os.replace(tmp, path)


def read_metrics_lines(ckpt_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(ckpt_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def damaged_file(ckpt_dir: str, parts: tuple[str, ...] = ("actor",)) -> str | None:
    """The first file of checkpoint `ckpt_dir` that is missing, truncated or unreadable, named with the
    reason; None when it is whole. `parts` are the DCP directories a resume loads (actor, critic).
    Cheap: every shard file the DCP metadata references must exist and reach the end of the last
    record it holds; the small trainer and RNG files are parsed."""
    import torch
    readers = ((STATE, TrainerState.read), ("metrics.jsonl", read_metrics_lines),
               ("config.yaml", lambda d: OmegaConf.load(os.path.join(d, "config.yaml"))))
    for name, read in readers:
        try:
            read(ckpt_dir)
        except Exception as exc:  # any parse error means the same thing: this file cannot be used
            return f"{os.path.join(ckpt_dir, name)} is unreadable ({type(exc).__name__}: {exc})"
    for part in parts:
        if (damage := _damaged_shard(os.path.join(ckpt_dir, part))) is not None:
            return damage
    rng_dir = os.path.join(ckpt_dir, "rng")
    for name in sorted(os.listdir(rng_dir)) if os.path.isdir(rng_dir) else []:
        try:
            torch.load(os.path.join(rng_dir, name), weights_only=True)
        except Exception as exc:
            return f"{os.path.join(rng_dir, name)} is unreadable ({type(exc).__name__}: {exc})"
    return None


def _damaged_shard(dcp_dir: str) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader

    meta = os.path.join(dcp_dir, ".metadata")
    if not os.path.exists(meta):
        return f"{meta} is missing (the model state was never written or was pruned)"
    try:
        records = FileSystemReader(dcp_dir).read_metadata().storage_data.values()
    except Exception as exc:
        return f"{meta} is unreadable ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for info in records:
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(dcp_dir, name)
        if not os.path.exists(path):
            return f"{path} is missing"
        if (have := os.path.getsize(path)) < size:
            return f"{path} is truncated ({have} bytes; its records end at byte {size})"
    return None
