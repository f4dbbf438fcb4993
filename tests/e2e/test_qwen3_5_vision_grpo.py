"""End to end: 2 GRPO steps of Qwen3.5 (a hybrid Gated DeltaNet vision-language checkpoint) on prompts with images.

`rlsp.main.run` on the tiny random qwen3_5 of tests/tiny_vl.py (transformers' classes; its tower without deepstack)
beside the tiny processor files of rlsp/models/tiny_vl.py (their vocabulary and vision token ids are the model's),
on the synthetic shapes task: because the rows carry images, the actor at Ulysses 2, the reference and the hf rollout
engine load the checkpoint with its vision tower (rlsp.data.vision_run) instead of as its text model; the engine
decodes with the model's own cache (Gated DeltaNet conv and recurrent state, gated attention keys) and interleaved
multimodal rope, and the trained weights -- tower included -- are synced into it after every update. Checked:
* both steps finish with finite metrics, and the start-up self-check (Ulysses 2 against an unsharded forward of the
  first step's image rows) passed;
* on both steps the largest per-token gap between the engine's sampling logprobs and the trainer's is within
  tests/tolerances.py's bound for two forwards of the model (a text-only engine, a wrong rope position or a failed
  sync moves it far above);
* the run's HF export (`actor_hf`) is the vision-language model: it loads with AutoModelForImageTextToText as
  Qwen3_5ForConditionalGeneration with its trained tower, and its processor files came along (the logits of such an
  export: tests/distributed/test_qwen3_5_vision_export.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_grpo_e2e import ray_session  # noqa: F401 (the module's shared Ray session)
from test_vision_grpo import run_vision_grpo
from tiny_vl import build_tiny_vl, hybrid_vl_config
from transformers import AutoModelForImageTextToText

from rlsp.data.vision_processor import load_processor
from rlsp.models.tiny_vl import write_tiny_vl_processor

pytestmark = pytest.mark.e2e


@pytest.mark.usefixtures("ray_session")
def test_qwen3_5_grpo_with_images_two_steps_ulysses2_hf_rollouts(tmp_path: Path, capsys) -> None:
    model = write_tiny_vl_processor(str(tmp_path / "model"))
    initial = build_tiny_vl(hybrid_vl_config("qwen3_5"))
    initial.save_pretrained(model)
    run_vision_grpo(tmp_path, model, capsys, **{"trainer.save_final_model": True})
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "run" / "actor_hf", dtype=torch.float32)
    assert type(exported).__name__ == "Qwen3_5ForConditionalGeneration"
    before, after = dict(initial.named_parameters()), dict(exported.named_parameters())
    assert before.keys() == after.keys()
    assert any(k.startswith("model.visual.") and not torch.equal(before[k], after[k]) for k in after)  # the tower trained
    assert load_processor("actor_hf", str(tmp_path / "run" / "actor_hf")).image_processor is not None
