"""End to end: 2 GRPO steps of a vision-language model on prompts with images, through rlsp's own entry.

`rlsp.main.run` on a tiny random Qwen2.5-VL (transformers' classes; its real processor files: the PIL image
processor, a tokenizer with the Qwen-VL vision tokens, a chat template with image parts) and the synthetic shapes
task (rlsp.data.tasks.shapes: one image per prompt, drawn with PIL): the dataset renders each prompt with the
processor (expanded image tokens, pixel values, grids), the hf rollout engine samples with the images
(rlsp.rollout.hf_vision: the model's own vision tower and multimodal rope), the actor at Ulysses 2 and the reference
read the same images (rlsp.models.vision_lm: one vision-tower pass per image, spread over the sequence-parallel
ranks), the trained weights -- vision tower included -- are synced into the engine after every update. Checked:
* both steps finish with finite metrics, and the start-up self-check (Ulysses 2 against an unsharded forward of the
  first step's image rows) passed;
* the update moved the policy (non-zero gradient norm);
* on both steps the largest per-token gap between the engine's sampling logprobs and the trainer's is within
  tests/tolerances.py's bound for two forwards of the model: the engine saw the same image tokens at the same
  multimodal positions as the trainer (a wrong rope position or a missing image moves it far above), and step 2's
  rollouts came from the synced weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_families_grpo import FINITE, OVERRIDES
from test_grpo_e2e import ray_session  # noqa: F401 (the module's shared Ray session)
from test_sequence_layouts_e2e import run_logprob_tol
from transformers import AutoConfig, AutoModelForImageTextToText

from rlsp.config.schema import RLSPConfig
from rlsp.data.tasks.shapes import write_shapes_parquet
from rlsp.models.tiny_vl import write_tiny_vl_dir

pytestmark = pytest.mark.e2e


def _vl_model(out: Path) -> str:
    """The tiny Qwen2.5-VL directory: processor files, config and random fp32 weights."""
    path = write_tiny_vl_dir(str(out))
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32).save_pretrained(path)
    return path


def run_vision_grpo(tmp_path: Path, model: str, capsys, **extra) -> list[dict]:
    """2 GRPO steps of `model` on the shapes task at Ulysses 2 (OVERRIDES, hf rollouts) through rlsp.main.run, with
    the checks every vision run shares: both steps finite, the start-up sp self-check on image rows passed, a non-zero
    gradient, and the engine's sampling logprobs within tests/tolerances.py's bound of the trainer's."""
    from rlsp.main import run

    train, test = write_shapes_parquet(str(tmp_path / "data"), n_train=8, n_test=2, image_size=24)
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in {**OVERRIDES, "actor_rollout_ref.model.path": model, "data.train_files": [train],
                     "data.val_files": [test], "data.max_prompt_length": 96,
                     "trainer.default_local_dir": str(tmp_path / "run"),
                     "trainer.cache_dir": str(tmp_path / "cache"), **extra}.items():
        OmegaConf.update(cfg, key, val)
    history = run(cfg)
    assert [m["step"] for m in history] == [1, 2]
    assert "sp self-check passed (actor)" in capsys.readouterr().err  # image rows at Ulysses 2 == unsharded
    tol = run_logprob_tol(tmp_path / "run")
    for metrics in history:
        for key in FINITE:
            assert isinstance(metrics[key], float) and math.isfinite(metrics[key]), (key, metrics.get(key))
        assert metrics["actor/grad_norm"] > 0.0
        assert metrics["rollout/logprob_diff_max"] <= tol, (metrics["step"], metrics["rollout/logprob_diff_max"], tol)
    return history


@pytest.mark.usefixtures("ray_session")
def test_vision_language_grpo_two_steps_ulysses2_hf_rollouts(tmp_path: Path, capsys) -> None:
    run_vision_grpo(tmp_path, _vl_model(tmp_path / "model"), capsys)
