"""The `auto` settings' shape of the built-in tiny vision-language model (rlsp.config.auto.BUILTIN_SHAPES
`builtin://tiny-qwen2.5-vl`): rlsp.config may not import rlsp.models, so its config numbers are written out there
(TINY_VL_CONFIG); here they are compared with rlsp.models.tiny_vl's spec and with the model the factory builds, so
they cannot drift, and the auto rules read the shape (text model and vision tower) before the model is built."""

from __future__ import annotations

from omegaconf import OmegaConf

from rlsp.config.auto import BUILTIN_SHAPES, TINY_VL_CONFIG, model_shape, resolve_auto
from rlsp.config.machine import GIB, Machine
from rlsp.config.model_shape import read_model_shape
from rlsp.config.schema import RLSPConfig
from rlsp.models.tiny_vl import (
    MERGE,
    PATCH,
    TEMPORAL,
    TinyVLSpec,
    build_tiny_vl_config,
    build_vl_tokenizer,
    ensure_tiny_vl_model,
)
from rlsp.run.assets import PREFIX, TINY_VL

BUILTIN = f"{PREFIX}{TINY_VL}"


def test_config_numbers_are_the_spec_and_its_built_config():
    spec, text, vision = TinyVLSpec(), TINY_VL_CONFIG["text_config"], TINY_VL_CONFIG["vision_config"]
    from_spec = {"num_hidden_layers": spec.num_hidden_layers, "hidden_size": spec.hidden_size,
                 "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_attention_heads,
                 "num_key_value_heads": spec.num_key_value_heads, "vocab_size": len(build_vl_tokenizer(spec.words)),
                 "max_position_embeddings": spec.max_position_embeddings}
    assert {k: text[k] for k in from_spec} == from_spec
    assert {k: vision[k] for k in ("depth", "hidden_size", "num_heads", "out_hidden_size", "patch_size",
                                   "spatial_merge_size", "temporal_patch_size")} == {
        "depth": spec.vision_depth, "hidden_size": spec.vision_hidden_size, "num_heads": spec.vision_heads,
        "out_hidden_size": spec.hidden_size, "patch_size": PATCH, "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL}
    built = build_tiny_vl_config(spec).to_dict()  # every number, against what the factory writes
    for section in ("text_config", "vision_config"):
        for key, value in TINY_VL_CONFIG[section].items():
            assert built[section][key] == value, (section, key, built[section][key], value)
    assert {k: built[k] for k in ("model_type", "tie_word_embeddings")} == \
        {k: TINY_VL_CONFIG[k] for k in ("model_type", "tie_word_embeddings")}


def test_builtin_shape_is_the_built_model(tmp_path):
    """Text layers (each layer's kind), vision tower and parameter count as read from the built model's files."""
    built = read_model_shape(ensure_tiny_vl_model(str(tmp_path / "vl")))
    shape, why = model_shape(BUILTIN)
    assert why == "" and shape is BUILTIN_SHAPES[BUILTIN]
    assert shape.__dict__ | {"name": built.name} == built.__dict__  # kinds, vision and model_type included
    assert shape.vision is not None and shape.vision.params > 0 and shape.params == built.params


def test_auto_rules_know_the_builtin_size():
    """The memory rules decide from the shape (tower included) instead of verl's defaults for an unknown size."""
    cfg = OmegaConf.structured(RLSPConfig)
    OmegaConf.update(cfg, "actor_rollout_ref.model.path", BUILTIN)
    errors: list[str] = []
    choices = {c.key: c for c in resolve_auto(cfg, errors, Machine("cpu", 12 * GIB, "test host"))}
    assert errors == []
    assert all("unknown" not in c.reason for c in choices.values()), [c.line() for c in choices.values()]
    assert choices["actor_rollout_ref.actor.fsdp_config.fsdp_size"].value == 1  # 0.5M parameters: replicated
    assert "the vision tower saves" in choices["actor_rollout_ref.model.enable_gradient_checkpointing"].reason
