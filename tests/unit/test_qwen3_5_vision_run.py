"""Qwen3.5 / Qwen3.5-MoE with images in a run: the hf rollout engine, the load decision and the checks.

The tiny hybrid vision-language models of tests/tiny_vl.py in a directory with the tiny processor of
rlsp/models/tiny_vl.py (its vocabulary and vision token ids are the model's). Checked:
* the hf rollout engine loaded with the tower (`vision_tower=True`) samples left-padded prompts with 0, 1 and 2 images
  (Gated DeltaNet conv and recurrent state and the gated attention's keys kept while decoding, interleaved
  multimodal rope continued after each prompt), and every sampled token's logprob equals the trainer's packed forward
  of the rows (rlsp.models.vision_lm, itself equal to transformers' per row: tests/unit/test_qwen3_5_vision.py) within
  tests/tolerances.py's bound; the trainer's parameter names (tower included) sync into it;
* without the tower it is the text model, and images are refused by name;
* the run decides from its data: rows with images load the tower, text rows the text model (rlsp.data.vision_run);
* rlsp.check accepts images on the wrapper with the hf engine and the processor files, and refuses by name what
  does not run with them (vLLM, a LoRA target found in the tower only, lean RMSNorm on its (1 + weight) norms, a
  directory without a processor); LoRA and tiled MLP take its language model.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from tiny_vl import HYBRID_VL_FAMILIES, IMAGE, PIXEL_DIM, build_tiny_vl, hybrid_vl_config, vl_rows
from tolerances import decoder_chain, logprob_tol

from rlsp.check import main as check_main
from rlsp.data.tasks.shapes import write_shapes_parquet
from rlsp.data.vision_run import policy_vision_tower, tower_switch_problem
from rlsp.models.loading import load_causal_lm
from rlsp.models.tiny_vl import write_tiny_vl_processor
from rlsp.rollout.base import SamplingConfig
from rlsp.rollout.hf_engine import HFEngine

P, R = 22, 5
GRIDS = [[], [[1, 4, 4]], [[1, 2, 4], [1, 4, 6]]]


def write_qwen3_5_vl(family: str, out_dir: str, seed: int = 0) -> str:
    """A tiny qwen3_5 / qwen3_5_moe directory with its tower's weights and the tiny processor files."""
    path = write_tiny_vl_processor(out_dir)
    build_tiny_vl(hybrid_vl_config(family), seed).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5_vl")
    out = {family: write_qwen3_5_vl(family, str(root / family)) for family in HYBRID_VL_FAMILIES}
    out["train"], _ = write_shapes_parquet(str(root / "data"), n_train=4, n_test=2, image_size=24)
    frame = pd.read_parquet(out["train"]).drop(columns=["images"])
    out["text"] = str(root / "text.parquet")
    frame.to_parquet(out["text"])
    return out


def _trainer_logprobs(lm, prompts: list[list[int]], responses: list[list[int]], entries: list) -> list[torch.Tensor]:
    """The trainer's logprobs of each row's response tokens: rlsp.models.vision_lm on the packed rows (prompts
    left-padded to P, image tokens counted in the prompts only, as in the run), one rank."""
    from rlsp.data.batch import Batch
    from rlsp.engine.micro import prepare_micro_batch
    from rlsp.models.family_checks import num_heads
    from rlsp.models.vision_lm import build_logprob_model

    ids = torch.zeros(len(prompts), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (prompt, resp) in enumerate(zip(prompts, responses)):
        ids[b, P - len(prompt):P + len(resp)] = torch.tensor(prompt + resp)
        mask[b, P - len(prompt):P + len(resp)] = 1
    rows = Batch.from_dict({"input_ids": ids, "attention_mask": mask}, meta={"multi_modal_inputs": list(entries)})
    micro = prepare_micro_batch(rows, P, None, *num_heads(lm.config.text_config))
    packed = micro.packed
    with torch.no_grad():
        out = build_logprob_model(lm)(packed.input_ids, packed.position_ids, packed.labels, sp_context=micro.ctx,
                                      **micro.multi_modal_kwargs())["logprobs"].double()
    got = torch.zeros(len(prompts), P + R - 1, dtype=torch.float64)
    real = packed.label_mask[:packed.num_real]
    got[packed.row_index[real], packed.col_index[real]] = out[:packed.num_real][real]
    return [got[b, P - 1:P - 1 + len(resp)] for b, resp in enumerate(responses)]  # log p(token c + 1) at column c


@pytest.mark.parametrize("family", HYBRID_VL_FAMILIES)
def test_hf_engine_samples_images_at_the_trainers_logprobs(dirs, family):
    engine = HFEngine(dirs[family], seed=0, vision_tower=True)
    assert engine.lean is None and engine.model.config.model_type == family
    rows = vl_rows(GRIDS, P, R)
    prompts = [[int(t) for t, m in zip(ids[:P], mask[:P]) if m] for ids, mask in
               zip(rows["input_ids"], rows["attention_mask"])]
    entries = rows.meta["multi_modal_inputs"]
    out = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_tokens=R, seed=3), images=entries)
    assert len(out.response_ids) == 2 * len(prompts)
    trainer = load_causal_lm(dirs[family], vision_tower=True)  # the actor's model: rlsp_ulysses, packed DeltaNet
    want = _trainer_logprobs(trainer, [prompts[b] for b in out.prompt_index], out.response_ids,
                             [entries[b] for b in out.prompt_index])
    worst = max(float((torch.tensor(lps, dtype=torch.float64) - w).abs().max())
                for lps, w in zip(out.response_logprobs, want))
    tol = logprob_tol(decoder_chain(trainer.config), len(out.response_ids) * (P + R))  # the tower counts as stages
    assert worst <= tol, (worst, tol)
    # weight sync: the actor's parameter names (tower included) are the engine's; update_weights raises on others
    assert any(n.startswith("model.visual.") for n, _ in trainer.named_parameters())
    engine.update_weights((n, p.detach()) for n, p in trainer.named_parameters())


def test_without_the_tower_the_engine_is_the_text_model_and_refuses_images(dirs):
    engine = HFEngine(dirs["qwen3_5"], seed=0)
    assert engine.model.config.model_type == "qwen3_5_text"
    entry = {"pixel_values": torch.zeros(4, PIXEL_DIM), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    with pytest.raises(ValueError, match="rollout model is a qwen3_5_text .text-only.*vision_tower=True"):
        engine.generate([[5, 6, IMAGE, 7]], SamplingConfig(max_tokens=2), images=[entry])
    with pytest.raises(ValueError, match="vision_tower=True: qwen3_next has no vision tower"):
        from rlsp.rollout.hf_vision import load_generation_model

        load_generation_model("unused", type("C", (), {"model_type": "qwen3_next"})(), torch.float32, None, True)


def _cfg(model: str, *files: str):
    from omegaconf import OmegaConf

    return OmegaConf.create({"actor_rollout_ref": {"model": {"path": model}},
                             "data": {"train_files": list(files), "val_files": None}})


def test_the_run_loads_the_tower_when_its_rows_carry_images(dirs, tmp_path):
    assert policy_vision_tower(_cfg(dirs["qwen3_5"], dirs["train"]))
    assert policy_vision_tower(_cfg(dirs["qwen3_5_moe"], dirs["text"], dirs["train"]))
    assert not policy_vision_tower(_cfg(dirs["qwen3_5"], dirs["text"]))
    with pytest.raises(RuntimeError, match="are not readable here"):
        policy_vision_tower(_cfg(dirs["qwen3_5"], str(tmp_path / "elsewhere.parquet")))


def _saved_model(tmp_path, model_type: str) -> str:
    """A checkpoint's actor/huggingface directory recording `model_type`."""
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(path)


def test_a_resume_that_switches_the_tower_on_or_off_is_refused_by_name(dirs, tmp_path):
    with_tower, text_only = _saved_model(tmp_path, "qwen3_5"), _saved_model(tmp_path, "qwen3_5_text")
    images, text = _cfg(dirs["qwen3_5"], dirs["train"]), _cfg(dirs["qwen3_5"], dirs["text"])
    assert tower_switch_problem(images, with_tower) is None and tower_switch_problem(text, text_only) is None
    problem = tower_switch_problem(images, text_only)
    assert "trained without the vision tower" in problem and "data has rows with images" in problem
    assert "trained with the vision tower" in tower_switch_problem(text, with_tower)
    assert tower_switch_problem(_cfg(dirs["qwen3_5"], dirs["train"]), _saved_model(tmp_path, "llama")) is None


def _check(tmp_path, model: str, train: str, *overrides: str, capsys) -> tuple[int, str]:
    rc = check_main(["trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={train}",
                     "data.val_files=null", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2", "data.max_prompt_length=96",
                     f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=hf",
                     "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", *overrides])
    return rc, capsys.readouterr().out


def test_check_accepts_images_and_refuses_what_does_not_run_with_them(dirs, tmp_path, capsys):
    rc, out = _check(tmp_path, dirs["qwen3_5"], dirs["train"], capsys=capsys)
    assert rc == 0, out
    rc, out = _check(tmp_path, dirs["qwen3_5"], dirs["train"], "actor_rollout_ref.rollout.name=vllm", capsys=capsys)
    assert rc == 2 and "actor_rollout_ref.rollout.name='vllm': prompts with images roll out with the hf engine" in out
    # LoRA and tiled MLP take the language model (rlsp.models.vision_lora); a LoRA target found in the tower only is
    # refused, and lean RMSNorm by the family's (1 + weight) norms
    rc, out = _check(tmp_path, dirs["qwen3_5"], dirs["train"], "actor_rollout_ref.model.lora_rank=4",
                     "actor_rollout_ref.model.tiled_mlp.enabled=true", capsys=capsys)
    assert rc == 0, out
    rc, out = _check(tmp_path, dirs["qwen3_5"], dirs["train"], "actor_rollout_ref.model.lora_rank=4",
                     "actor_rollout_ref.model.target_modules=[linear_fc1]", capsys=capsys)
    assert rc == 2 and "target_modules names 'linear_fc1': a layer of the vision tower only" in out, out
    rc, out = _check(tmp_path, dirs["qwen3_5"], dirs["train"], "actor_rollout_ref.model.lean_rmsnorm=true", capsys=capsys)
    assert rc == 2 and "RMSNorm scales by (1 + weight)" in out, out
    rc, out = _check(tmp_path, dirs["qwen3_5"], dirs["train"], "algorithm.adv_estimator=gae", capsys=capsys)
    assert rc == 0, out  # the critic from the actor's model loads its tower too (rlsp.models.critic_vision)


def test_tp_takes_the_wrappers_text_model_and_refuses_its_tower(dirs, tmp_path, capsys):
    """tp 2 runs a wrapper's text model (its Gated DeltaNet split by key-head groups: rlsp.parallel.tp_linear_attention)
    and is refused by role, naming the images, when the run's rows load the tower."""
    tp = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=1", "actor_rollout_ref.actor.tensor_model_parallel_size=2")
    rc, out = _check(tmp_path, dirs["qwen3_5"], dirs["text"], *tp, capsys=capsys)
    assert rc == 0, out
    rc, out = _check(tmp_path, dirs["qwen3_5"], dirs["train"], *tp, capsys=capsys)
    assert rc == 2 and ("actor_rollout_ref.actor.tensor_model_parallel_size=2: the qwen3_5 checkpoint loads with its "
                        "vision tower in this run") in out, out
