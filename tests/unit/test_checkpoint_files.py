"""Checkpoint directory rules: atomic visibility, the latest pointer, pruning, and the resume decision
(a run directory that holds a run is resumed or refused, never overwritten)."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

import rlsp.run.checkpoint as ckpt
from rlsp.config.schema import RLSPConfig
from rlsp.run.checkpoint import CheckpointWriter, TrainerState, latest_checkpoint, resolve_resume


def _save(writer: CheckpointWriter, step: int) -> str:
    tmp = writer.begin(step)
    for part in ("actor", "critic"):
        os.makedirs(os.path.join(tmp, part))
        open(os.path.join(tmp, part, "__0_0.distcp"), "w").close()
    state = TrainerState(step=step, epoch=0, batch_in_epoch=step, kl_ctrl={"value": 0.1}, layout="world=1")
    return writer.commit(tmp, step, state, [f'{{"step": {s}}}\n' for s in range(1, step + 1)], "a: 1\n")


def _cfg(run_dir, **overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    OmegaConf.update(cfg, "trainer.default_local_dir", str(run_dir))
    for key, val in overrides.items():
        OmegaConf.update(cfg, key, val)
    return cfg


def test_save_is_atomic_and_the_pointer_moves_last(tmp_path, monkeypatch):
    writer = CheckpointWriter(str(tmp_path), None, None)
    first = _save(writer, 2)
    assert latest_checkpoint(str(tmp_path)) == first
    assert TrainerState.read(first).batch_in_epoch == 2
    # A save of step 4 dies after the model shards were written, while writing the trainer files.
    tmp = writer.begin(4)
    os.makedirs(os.path.join(tmp, "actor"))
    real_write = ckpt._write

    def dying_write(path, text):
        if path.endswith("metrics.jsonl"):
            raise OSError("disk full")
        real_write(path, text)

    monkeypatch.setattr(ckpt, "_write", dying_write)
    state = TrainerState(step=4, epoch=0, batch_in_epoch=4, kl_ctrl={}, layout="world=1")
    with pytest.raises(OSError, match="disk full"):
        writer.commit(tmp, 4, state, [], "")
    monkeypatch.setattr(ckpt, "_write", real_write)
    assert latest_checkpoint(str(tmp_path)) == first
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (tmp_path / "global_step_4").exists()
    assert resolve_resume(_cfg(tmp_path)) == first
    # The next save of step 4 starts from a clean temporary directory and succeeds.
    assert latest_checkpoint(str(tmp_path)) == first
    assert _save(writer, 4) == latest_checkpoint(str(tmp_path))


def test_pointer_to_a_missing_checkpoint_falls_back_to_the_newest_complete(tmp_path):
    writer = CheckpointWriter(str(tmp_path), None, None)
    _save(writer, 1)
    newest = _save(writer, 3)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    assert latest_checkpoint(str(tmp_path)) == newest


def test_pruning_keeps_the_newest_model_states(tmp_path):
    writer = CheckpointWriter(str(tmp_path), max_actor=2, max_critic=1)
    for step in (1, 2, 3):
        _save(writer, step)
    present = {s: sorted(p for p in ("actor", "critic") if (tmp_path / f"global_step_{s}" / p).exists()) for s in (1, 2, 3)}
    assert present == {1: [], 2: ["actor"], 3: ["actor", "critic"]}


def test_a_run_directory_is_resumed_or_refused(tmp_path):
    assert resolve_resume(_cfg(tmp_path / "new")) is None  # nothing there: a fresh run
    (tmp_path / "config.yaml").write_text("a: 1\n")  # a run that failed before its first step
    assert resolve_resume(_cfg(tmp_path)) is None
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(ValueError, match="already holds a run \\(metrics of 2 steps and no checkpoint\\)"):
        resolve_resume(_cfg(tmp_path))
    latest = _save(CheckpointWriter(str(tmp_path), None, None), 2)
    assert resolve_resume(_cfg(tmp_path)) == latest
    with pytest.raises(ValueError, match="use trainer.resume_mode=auto to continue it"):
        resolve_resume(_cfg(tmp_path, **{"trainer.resume_mode": "disable"}))
    other = _cfg(tmp_path / "elsewhere", **{"trainer.resume_mode": "resume_path", "trainer.resume_from_path": latest})
    assert resolve_resume(other) == latest
    with pytest.raises(ValueError, match="needs trainer.resume_from_path to be a complete checkpoint"):
        resolve_resume(_cfg(tmp_path / "x", **{"trainer.resume_mode": "resume_path"}))
