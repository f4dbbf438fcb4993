"""End to end LoRA: `python -m rlsp.main` with actor_rollout_ref.model.lora_rank=4 and the KL loss on
(reference = the actor's base with the adapters off), vLLM rollouts, two GRPO steps.

* vLLM samples from the merged weights the trainer differentiates: rollout/logprob_diff_max within
  tests/tolerances.py's bound for two forwards of the model (test_sequence_layouts_e2e.run_logprob_tol)
  on both steps (vLLM starts from random weights, rollout.load_format=dummy: step 1 proves the sync
  at start-up, step 2 the sync of base + scale * B @ A after the update);
* the KL loss sees a reference that stayed the base while the adapters moved (kl_loss > 0 on step 2);
* the checkpoint holds adapters and their optimizer state only;
* the export holds the PEFT adapter, and the merged model differs from the base by exactly
  scale * B @ A in the adapted layers and not at all elsewhere (only adapter weights changed).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from test_grpo_e2e import _main
from test_sequence_layouts_e2e import run_logprob_tol
from tolerances import roundoff_rtol, scalar_tol
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.e2e

LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.optim.lr=2e-2", "actor_rollout_ref.rollout.name=vllm",
        # one optimizer step per training step: step 1 starts from B = 0 (policy = reference, KL 0) and
        # its old logprobs are the update's own forward, so the reference pass is the run's first forward
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        # vLLM starts from random weights: the actor's arrive by the sync before anything is generated
        "actor_rollout_ref.rollout.load_format=dummy",
        "trainer.total_training_steps=2", "trainer.test_freq=0")


def _is_adapter(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def test_lora_grpo_with_kl_through_the_cli(tmp_path):
    proc = _main(tmp_path, *LORA)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert r["rollout/logprob_diff_max"] <= run_logprob_tol(run), (r["step"], r["rollout/logprob_diff_max"])
    assert lines[0]["actor/kl_loss"] == 0.0 and lines[1]["actor/kl_loss"] > 0.0
    meta = dcp.FileSystemReader(str(run / "global_step_2" / "actor")).read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    optim_keys = [k for k in meta.state_dict_metadata if k.startswith("optimizer.state.")]
    assert model_keys and all(_is_adapter(k) for k in model_keys)
    assert optim_keys and all(_is_adapter(k) for k in optim_keys)

    adapter_dir = run / "actor_hf" / "lora_adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)  # the adapters trained
    merged = AutoModelForCausalLM.from_pretrained(run / "actor_hf", dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tmp_path.parent / "cache" / "models" / "tiny-qwen2",
                                                dtype=torch.float32).state_dict()
    assert merged.keys() == base.keys()
    scale = config["lora_alpha"] / config["r"]
    adapted = 0
    for name, w in base.items():
        stem = name.removesuffix(".weight")
        a_key = next((k for k in adapter if k.endswith(f"{stem}.lora_A.weight")), None)
        if a_key is None:
            assert torch.equal(merged[name], w), f"{name} has no adapter but changed"
            continue
        delta = scale * adapter[a_key.replace("lora_A", "lora_B")] @ adapter[a_key]
        # the merge's r-term product and its addition to w, rounded in fp32 on both sides (tests/tolerances.py)
        tol = scalar_tol(float(w.abs().max() + delta.abs().max()), roundoff_rtol(reduction=config["r"], stages=2))
        torch.testing.assert_close(merged[name] - w, delta, rtol=0, atol=tol)
        adapted += 1
    assert adapted == 7 * int(json.loads((tmp_path.parent / "cache" / "models" / "tiny-qwen2" / "config.json")
                                          .read_text())["num_hidden_layers"])
    assert os.path.exists(run / "actor_hf" / "tokenizer_config.json")
