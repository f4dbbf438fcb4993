"""LoRA keys (verl's names) and the rollout loading keys: validation names the value and the legal
values; target/exclude lists reach peft; layers an adapter must not wrap are refused."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.models.loading import load_causal_lm
from rlsp.models.lora import LoraSettings, apply_lora
from rlsp.models.tiny import TinyModelSpec, build_tiny_model


def _validate(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in overrides.items():
        OmegaConf.update(cfg, key, val)
    return validate_config(cfg)


def _error(**overrides) -> str:
    with pytest.raises(ValueError) as exc:
        _validate(**overrides)
    return str(exc.value)


def test_lora_keys_accepted():
    _validate(**{"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.target_modules": ["q_proj", "v_proj"],
                 "actor_rollout_ref.model.exclude_modules": ["v_proj"], "actor_rollout_ref.rollout.load_format": "dummy"})


@pytest.mark.parametrize("overrides,expected", [
    ({"actor_rollout_ref.model.lora_rank": -1}, "lora_rank=-1 must be an integer >= 0"),
    ({"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.lora_alpha": 0},
     "lora_alpha=0.0 must be a number > 0"),
    ({"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.target_modules": "attention"},
     "target_modules='attention' is not supported; legal values: 'all-linear' or a list"),
    ({"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.target_modules": ["q_proj", "lm_head"]},
     "names ['lm_head']"),
    ({"actor_rollout_ref.model.lora_adapter_path": "/no/such/adapter"}, "is not a PEFT adapter directory"),
    ({"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.actor.tensor_model_parallel_size": 2},
     "LoRA is not supported with tensor parallelism"),
    ({"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 2},
     "with LoRA the reference is the actor's own model"),
    ({"actor_rollout_ref.rollout.load_format": "dummy_dtensor"},
     "load_format='dummy_dtensor' is not supported; legal values: ['auto', 'safetensors', 'dummy']"),
    ({"actor_rollout_ref.rollout.load_format": "safetensors", "actor_rollout_ref.rollout.name": "hf"},
     "legal values here: ['auto']"),
    ({"actor_rollout_ref.rollout.layered_summon": False}, "layered_summon=false is not supported"),
])
def test_bad_values_are_named_with_the_legal_ones(overrides, expected):
    assert expected in _error(**overrides)


def test_reference_layout_only_matters_with_a_kl_term():
    _validate(**{"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 2,
                 "actor_rollout_ref.actor.use_kl_loss": False})


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    return build_tiny_model(spec, str(tmp_path_factory.mktemp("tiny")))


def test_targets_and_excludes_reach_peft(tiny_path):
    lm = load_causal_lm(tiny_path)
    adapters = apply_lora(lm, LoraSettings(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj", "down_proj"),
                                           exclude_modules=("down_proj",)))
    assert sorted({n.rsplit(".", 1)[-1] for n in adapters.layers}) == ["q_proj", "v_proj"]
    assert len(adapters.layers) == 2 * 2 and set(adapters.scaling.values()) == {2.0}
    trainable = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(adapters.layers)


def test_an_adapter_on_the_output_layer_is_refused(tiny_path):
    with pytest.raises(ValueError, match="LoRA targets must be nn.Linear layers inside the decoder"):
        apply_lora(load_causal_lm(tiny_path), LoraSettings(rank=2, alpha=4.0, target_modules=("lm_head",)))
