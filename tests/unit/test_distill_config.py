"""distillation.* (verl's keys): validation names the key, the value and what is legal; the teacher table
and routing; the start-up checks of vocabularies and data_source routes (rlsp.step.distill)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rlsp.config.compose import compose_config
from rlsp.config.run_spec import TeacherSpec, teacher_specs
from rlsp.config.schema import RLSPConfig
from rlsp.config.validate import validate_config
from rlsp.models.tiny import TinyModelSpec, build_tiny_model
from rlsp.step.distill import Distillation
from rlsp.workers.roles.teacher import route_rows

ON = {"distillation.enabled": True, "distillation.teacher_models.teacher_model.model_path": "/models/teacher"}


def _cfg(**overrides):
    cfg = OmegaConf.structured(RLSPConfig)
    for key, val in overrides.items():
        OmegaConf.update(cfg, key, val, force_add=True)
    return cfg


def _error(**overrides) -> str:
    with pytest.raises(ValueError) as exc:
        validate_config(_cfg(**overrides))
    return str(exc.value)


def test_off_by_default_and_no_teacher_role():
    layout = validate_config(_cfg())
    assert "teacher" not in layout.roles_of("policy")


def test_one_teacher_scores_every_row():
    cfg = _cfg(**ON)
    layout = validate_config(cfg)
    assert layout.roles_of("policy")[-1] == "teacher" and layout.role("teacher") == layout.ref
    (spec,) = teacher_specs(cfg)
    assert spec == TeacherSpec("teacher_model", None, "/models/teacher", "float32")
    assert route_rows(["a", "b"], [spec]) == ["teacher_model", "teacher_model"]


def test_several_teachers_routed_by_data_source_from_the_command_line():
    cfg = compose_config(overrides=[
        "distillation.enabled=true", "+distillation.teacher_models.math.key=gsm8k",
        "+distillation.teacher_models.math.model_path=/m", "+distillation.teacher_models.geo.key=geo3k",
        "+distillation.teacher_models.geo.model_path=/g", "+distillation.teacher_models.geo.inference.dtype=bfloat16"])
    validate_config(cfg)
    specs = teacher_specs(cfg)  # the unconfigured default entry is dropped, as in verl
    assert [(s.name, s.key, s.model_path, s.dtype) for s in specs] == [
        ("math", "gsm8k", "/m", "float32"), ("geo", "geo3k", "/g", "bfloat16")]
    assert route_rows(["geo3k", "gsm8k", "geo3k"], specs) == ["geo", "math", "geo"]
    with pytest.raises(ValueError, match=r"rows with teacher key\(s\) \['other'\] match no distillation teacher; "
                                         r"teacher keys: \['geo3k', 'gsm8k'\]"):
        route_rows(["gsm8k", "other"], specs)


@pytest.mark.parametrize("overrides,expected", [
    ({"distillation.teacher_models.teacher_model.model_path": None},
     "distillation.teacher_models.teacher_model.model_path is missing"),
    ({"distillation.distillation_loss.loss_mode": "forward_kl_topk"},
     "loss_mode='forward_kl_topk' is not supported: it needs the teachers' top-k distributions"),
    ({"distillation.distillation_loss.loss_mode": "k9"}, "loss_mode='k9' is unknown; legal: k1, kl, abs, k2, mse, k3"),
    ({"distillation.distillation_loss.use_policy_gradient": False}, "use_policy_gradient=false"),
    ({"distillation.distillation_loss.policy_loss_mode": "gspo"}, "policy_loss_mode='gspo'; legal: vanilla"),
    ({"distillation.distillation_loss.clip_ratio_high": 0.28}, "clip_ratio_low/high=(0.2, 0.28) differ from the "
                                                               "actor's clip range (0.2, 0.2)"),
    ({"distillation.distillation_loss.loss_max_clamp": 0.0}, "loss_max_clamp=0.0 must be > 0 or null"),
    ({"distillation.distillation_loss.log_prob_min_clamp": 1.0}, "log_prob_min_clamp=1.0 must be < 0"),
    ({"distillation.n_gpus_per_node": -1}, "distillation.n_gpus_per_node=-1 must be >= 0"),  # any pool: colocated
    ({"distillation.enable_resource_pool": True}, "enable_resource_pool=true is not supported"),
    ({"distillation.teacher_key": "ability"}, "teacher_key='ability' is not a row field rlsp routes by; legal: data_source"),
    ({"distillation.teacher_models.teacher_model.num_replicas": -1}, "num_replicas=-1 must be >= 0"),
    ({"distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size": 0},
     "inference.tensor_model_parallel_size=0 must be >= 1"),
    ({"distillation.teacher_models.teacher_model.inference.name": "trtllm"},
     "inference.name='trtllm' is not supported; legal: vllm, sglang, hf"),
    ({"distillation.teacher_models.teacher_model.inference.dtype": "fp8"}, "inference.dtype='fp8'; legal: float32"),
    ({"distillation.teacher_models.teacher_model.inference.max_model_len": 40},
     "inference.max_model_len=40 < max_prompt_length + max_response_length + 1 = 41"),
    ({"distillation.teacher_models.teacher_model.inference.swap_space": 4},
     "distillation.teacher_models.teacher_model: Key 'swap_space' not in 'TeacherInferenceConfig'"),
])
def test_bad_values_are_named(overrides, expected):
    assert expected in _error(**{**ON, **overrides})


def test_several_teachers_need_distinct_keys():
    two = {"distillation.enabled": True, "distillation.teacher_models.a": {"model_path": "/a", "key": "x"},
           "distillation.teacher_models.b": {"model_path": "/b"}}
    assert "with several teachers each needs a `key` (the data_source value routed to it); missing for: b" in _error(**two)
    two["distillation.teacher_models.b"] = {"model_path": "/b", "key": "x"}
    assert "key 'x' is given to both a and b" in _error(**two)


def test_the_actor_loss_must_be_vanilla():
    cfg = _cfg(**ON)
    pl = cfg.actor_rollout_ref.actor.policy_loss
    if isinstance(pl, str):
        cfg.actor_rollout_ref.actor.policy_loss = "cispo"
    else:
        pl.loss_mode = "cispo"
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.policy_loss='cispo' with distillation"):
        validate_config(cfg)


class _Rows:
    def __init__(self, *sources: str) -> None:
        self.items = [{"data_source": s} for s in sources]


def test_start_up_checks_vocabulary_and_routes(tmp_path):
    spec = TinyModelSpec(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    student = build_tiny_model(spec, str(tmp_path / "student"))
    teacher = build_tiny_model(spec, str(tmp_path / "teacher"))
    tok = AutoTokenizer.from_pretrained(student)
    cfg = _cfg(**{**ON, "distillation.teacher_models.teacher_model.model_path": teacher})
    assert Distillation.build(cfg, tok, [_Rows("arithmetic"), None]) is not None
    assert Distillation.build(_cfg(), tok, []) is None
    keyed = _cfg(**{**ON, "distillation.teacher_models.teacher_model.model_path": teacher,
                    "distillation.teacher_models.teacher_model.key": "arithmetic"})
    with pytest.raises(ValueError, match=r"data rows with teacher key\(s\) \['gsm8k'\] match no distillation teacher"):
        Distillation.build(keyed, tok, [_Rows("arithmetic", "gsm8k")])
    other = AutoTokenizer.from_pretrained(student)
    other.add_tokens(["<extra_token>"])
    with pytest.raises(ValueError, match=r"the teacher's tokenizer differs from the student's \(\d+ vs \d+ tokens"):
        Distillation.build(cfg, other, [])
    missing = _cfg(**{**ON, "distillation.teacher_models.teacher_model.model_path": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="cannot be loaded as a Hugging Face model with a tokenizer"):
        Distillation.build(missing, tok, [])
