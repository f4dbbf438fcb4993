"""LoRA, tiled MLP and lean RMSNorm on a vision-language model's language model only (rlsp.models.vision_lora).

On the tiny models of tests/tiny_vl.py (Qwen2.5-VL, whose tower MLPs share the text layers' names gate/up/down_proj;
Qwen3-VL with its deepstack mergers; a Qwen3.5 wrapper loaded with its tower):
* `apply_lora` adapts every linear layer of the language model (all-linear: 7 per layer, Qwen3.5's Gated DeltaNet
  layers their own projections) and none under `model.visual`; named targets and a user's `exclude_modules` keep
  their meaning; only the adapters train, the tower stays frozen;
* `merge_for_rollout` gives peft's own `merge_and_unload` weights for every tensor, under the names the hf rollout
  engine's weight sync takes (its model's parameter names);
* a continued adapter that adapts tower layers is refused by name;
* tiled MLP and lean RMSNorm swap the language model's modules only, and the model's forward with images equals the
  plain one within tests/tolerances.py's bound;
* rlsp.check on recipes/grpo_vlm_cpu's command with lora_rank=8 (and tiled MLP, lean RMSNorm) passes; a target found
  only in the tower (qkv), and a saved adapter with tower layers, are refused by name.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from tiny_vl import build_tiny_vl, hf_logprobs, hybrid_vl_config, vl_config, vl_rows
from tolerances import assert_tensor_close, decoder_chain, logprob_tol, model_rtol
from torch import nn

from rlsp.models.lora import LoraSettings, apply_lora, is_adapter_param
from rlsp.models.rms_norm import LeanRMSNorm, apply_lean_rmsnorm
from rlsp.models.tiled_mlp import TiledMLP, apply_tiled_mlp
from rlsp.models.vision_lora import language_model, note_frozen_tower, tower_excluded

P, R = 22, 6
GRIDS = [[], [[1, 4, 4]], [[1, 2, 4], [1, 4, 6]], [[1, 4, 2]]]
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")
# adapted layers: 2 layers x (q, k, v, o, gate, up, down); Qwen3-VL-MoE: attention only (its experts are fused
# tensors, its routers no nn.Linear); Qwen3.5: 2 Gated DeltaNet layers x (in_proj_qkv, _z, _a, _b, out_proj + the
# MLP's 3) and 1 full-attention layer x 7
ADAPTED = {"qwen2_5_vl": 14, "qwen3_vl": 14, "qwen3_vl_moe": 8, "qwen3_5": 23}


def _model(family: str) -> nn.Module:
    return build_tiny_vl(hybrid_vl_config(family) if family == "qwen3_5" else vl_config(family))


def _linears(lm: nn.Module, tower: bool) -> set[str]:
    return {n for n, m in lm.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"
            and n.startswith("model.visual.") == tower}


def _adapted(adapters) -> set[str]:
    return set(adapters.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_all_linear_adapts_the_language_model_only(family):
    lm = _model(family)
    text, tower = _linears(lm, tower=False), _linears(lm, tower=True)
    adapters = apply_lora(lm, LoraSettings(rank=4, alpha=8.0))
    assert tower and _adapted(adapters) == text
    assert len(text) == ADAPTED[family]
    assert not any(n.startswith("model.visual.") for n in adapters.layers)
    trainable = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_param(n) and not n.startswith("model.visual.") for n in trainable)
    assert len(trainable) == 2 * len(text)


def test_named_targets_and_exclusions_keep_their_meaning():
    """gate_proj names a text MLP and a tower MLP layer in Qwen2.5-VL: only the text ones get adapters; the user's
    exclude list and regex still apply beside the tower's."""
    lm = _model("qwen2_5_vl")
    adapters = apply_lora(lm, LoraSettings(rank=4, alpha=8.0, target_modules=("gate_proj", "q_proj"),
                                           exclude_modules=("layers.1.self_attn.q_proj",)))
    assert _adapted(adapters) == {"model.language_model.layers.0.mlp.gate_proj", "model.language_model.layers.1.mlp.gate_proj",
                                  "model.language_model.layers.0.self_attn.q_proj"}
    lm = _model("qwen2_5_vl")
    attention = {n for n in _linears(lm, tower=False) if ".mlp." not in n}
    adapters = apply_lora(lm, LoraSettings(rank=4, alpha=8.0, exclude_modules=r".*\.mlp\..*"))
    assert _adapted(adapters) == attention and len(attention) == 8
    assert tower_excluded(nn.Linear(1, 1), "x") == "x"  # a model without a tower: unchanged


def test_lora_says_once_that_the_tower_stays_frozen():
    """actor.freeze_vision_tower=false (verl's default) with LoRA: one start-up line, not a refusal."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("rlsp.models.lora")
    logger.addHandler(handler)
    try:
        note_frozen_tower(nn.Linear(1, 1), freeze_vision_tower=False)  # no tower: nothing to say
        note_frozen_tower(_model("qwen2_5_vl"), freeze_vision_tower=True)  # frozen as asked
        note_frozen_tower(_model("qwen2_5_vl"), freeze_vision_tower=False)
        note_frozen_tower(_model("qwen2_5_vl"), freeze_vision_tower=False)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "LoRA: the vision tower stays frozen (LoRA trains the language model's adapters only); "
        "actor_rollout_ref.actor.freeze_vision_tower=false has no effect"]


def _randomize_b(lm: nn.Module, seed: int = 0) -> None:
    """peft starts B at zero (the merge would be the base); draw it so that the merge matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_merge_for_rollout_equals_peft_merge_and_unload(family):
    config = vl_config(family)
    config.tie_word_embeddings = True  # Qwen2.5-VL 3B's convention: the output layer is the embedding
    lm = build_tiny_vl(config)
    adapters = apply_lora(lm, LoraSettings(rank=4, alpha=8.0))
    _randomize_b(lm)
    named = list(lm.named_parameters()) + [("lm_head.weight", lm.lm_head.weight)]  # what the engine's sync sends
    merged = {n: t.detach() for n, t in adapters.merge_for_rollout((n, t.detach()) for n, t in named)}
    reference = copy.deepcopy(adapters.peft_model).merge_and_unload()
    want = dict(reference.named_parameters())
    want["lm_head.weight"] = reference.lm_head.weight
    assert set(merged) == set(want)  # the hf rollout engine's update_weights takes exactly its parameter names
    rtol = model_rtol(config.text_config, 4)  # W + s * B @ A: a rank-4 reduction, in either order
    for name, w in want.items():
        assert_tensor_close(merged[name], w.detach(), rtol)
    moved = [n for n in adapters.layers if not torch.equal(merged[f"{n}.weight"], dict(named)[f"{n}.base_layer.weight"])]
    assert sorted(moved) == sorted(adapters.layers)


def test_a_continued_adapter_with_tower_layers_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model

    lm = _model("qwen3_vl")
    get_peft_model(lm, LoraConfig(r=2, target_modules=["qkv", "q_proj"])).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="adapts 2 vision-tower layers"):
        apply_lora(_model("qwen3_vl"), LoraSettings(rank=0, alpha=1.0, adapter_path=str(tmp_path)))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_tiled_mlp_and_lean_rmsnorm_take_the_language_model_and_keep_the_forward(family):
    config = vl_config(family)
    plain, lm = build_tiny_vl(config), build_tiny_vl(config)
    tower_types = {n: type(m) for n, m in lm.model.visual.named_modules()}
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in lm.model.language_model.modules())
    apply_tiled_mlp(language_model(lm), 3)
    assert apply_lean_rmsnorm(language_model(lm)) == norms > 0
    assert all(isinstance(layer.mlp, TiledMLP) for layer in lm.model.language_model.layers)
    assert {n: type(m) for n, m in lm.model.visual.named_modules()} == tower_types  # the tower's own modules
    assert not any(isinstance(m, (LeanRMSNorm, TiledMLP)) for m in lm.model.visual.modules())
    rows = vl_rows(GRIDS, P, R)
    mask = rows["attention_mask"][:, 1:].bool() & rows["attention_mask"][:, :-1].bool()
    with torch.no_grad():
        want, got = hf_logprobs(plain, rows)[mask], hf_logprobs(lm, rows)[mask]
    tol = logprob_tol(decoder_chain(config), len(GRIDS) * (P + R), value_scale=float(want.abs().max()))
    assert float((got - want).abs().max()) <= tol


def _check(tmp_path, *extra: str):
    from test_vlm_recipe import RUN_SH, _command

    from rlsp.check import run_checks
    from rlsp.data.tasks import shapes

    text, data = RUN_SH.read_text(), str(tmp_path / "data")
    if not (tmp_path / "data").exists():
        shapes.main(_command(text, "rlsp.data.tasks.shapes", data))
    return run_checks([*_command(text, "rlsp.main", data), f"trainer.cache_dir={tmp_path / 'cache'}",
                       f"trainer.default_local_dir={tmp_path / 'run'}", *extra])


def test_check_takes_lora_on_the_vlm_recipe_and_refuses_a_tower_target(tmp_path):
    report = _check(tmp_path, "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                    "actor_rollout_ref.model.tiled_mlp.enabled=true", "actor_rollout_ref.model.lean_rmsnorm=true")
    assert report.problems == [], report.render()
    report = _check(tmp_path, "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[q_proj,qkv]")
    assert len(report.problems) == 1, report.render()
    problem = report.problems[0]
    assert "target_modules names 'qkv': a layer of the vision tower only (model.visual.blocks.0.attn.qkv" in problem
    assert "legal names: ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']" in problem
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(tmp_path / "cache" / "models" / "tiny-qwen2.5-vl")
    get_peft_model(base, LoraConfig(r=2, target_modules=["qkv", "q_proj"])).save_pretrained(str(tmp_path / "adapter"))
    report = _check(tmp_path, f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}")
    assert len(report.problems) == 1 and "adapts 2 vision-tower layers" in report.problems[0], report.render()
