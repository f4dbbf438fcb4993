"""End to end: 2 GRPO steps of a vision-language model with LoRA on its language model, through rlsp's own entry.

tests/e2e/test_vision_grpo.py's run (a tiny Qwen2.5-VL with its real processor files, the shapes task, hf rollouts
with the images, the actor at Ulysses 2) with actor_rollout_ref.model.lora_rank=4 and the KL loss on, so the
reference is the actor's base with the adapters off. Checked, besides that run's checks (finite metrics, the sp
self-check on image rows, the engine's sampling logprobs within tests/tolerances.py's bound of the trainer's on both
steps: step 2's rollouts came from the merged weights W + scale * B @ A the sync sent):
* the KL loss sees a reference that stayed the base while the adapters moved (0 on step 1, where B = 0, > 0 on step 2);
* the checkpoint holds the language model's adapters and their optimizer state only (no tower weight, no base);
* the export (`actor_hf/`) holds the PEFT adapter (no tower layer), the processor files, and a merged
  vision-language model that transformers loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from test_grpo_e2e import ray_session  # noqa: F401 (the module's shared Ray session)
from test_vision_grpo import _vl_model, run_vision_grpo
from transformers import AutoModelForImageTextToText

from rlsp.data.vision_processor import PROCESSOR_FILES

pytestmark = pytest.mark.e2e

LORA = {"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.lora_alpha": 8,
        "actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.kl_loss_coef": 0.1,
        "actor_rollout_ref.actor.optim.lr": 2e-2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,  # one optimizer step per training step (KL 0 on step 1)
        "trainer.save_final_model": True}


def _is_adapter(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


@pytest.mark.usefixtures("ray_session")
def test_vision_language_lora_grpo_two_steps(tmp_path: Path, capsys) -> None:
    history = run_vision_grpo(tmp_path, _vl_model(tmp_path / "model"), capsys, **LORA)
    assert history[0]["actor/kl_loss"] == 0.0 and history[1]["actor/kl_loss"] > 0.0
    run = tmp_path / "run"
    meta = dcp.FileSystemReader(str(run / "global_step_2" / "actor")).read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    optim_keys = [k for k in meta.state_dict_metadata if k.startswith("optimizer.state.")]
    assert model_keys and all(_is_adapter(k) and ".language_model." in k for k in model_keys)
    assert optim_keys and all(_is_adapter(k) for k in optim_keys)
    export = run / "actor_hf"
    adapter = load_file(str(export / "lora_adapter" / "adapter_model.safetensors"))
    assert adapter and not any("visual" in k for k in adapter)
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)  # the adapters trained
    assert json.loads((export / "lora_adapter" / "adapter_config.json").read_text())["r"] == 4
    assert any((export / name).exists() for name in PROCESSOR_FILES)
    merged = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    assert any(n.startswith("model.visual.") for n, _ in merged.named_parameters())
