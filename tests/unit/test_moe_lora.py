"""LoRA on the MoE families whose experts transformers 5 fuses (rlsp/models/lora_targets.py, lora_experts.py).

peft's v4 -> v5 config conversion, measured on these tiny models with target_modules=all-linear: qwen3_moe, mixtral,
olmoe, glm4_moe, deepseek_v3 and qwen3_next get `ParamWrapper` adapters on `mlp.experts` (gate_up_proj at rank 2r,
down_proj) and on the router (`mlp.gate.weight`), and the dense first layers' MLPs and the shared experts lose
their adapters (their gate_proj/up_proj/down_proj names are moved onto the experts). rlsp's all-linear adapts exactly
the nn.Linear layers instead, checked here per family:

* the adapted layers are every nn.Linear but the output layer (the expected leaf kinds are spelled out per family),
  none inside the fused experts, none on a router; experts and routers stay frozen;
* `merge_for_rollout` equals peft's merge_and_unload for every tensor, bit for bit;
* a saved adapter reloads (continue from it; export's merge) onto the same layers;
* an explicit target that names only a router (or the experts module itself, or another family's expert name) is
  refused by name, in the engine and in rlsp.check; so is a saved adapter with tensors on the router (peft's
  all-linear adapters) or per-expert transformers 4 tensors; a tiny qwen3_moe run with lora_rank 8 passes rlsp.check.

A target list naming the expert projections (qwen3_moe: gate_proj/up_proj/down_proj, mixtral: w1/w3/w2) adapts the
fused experts with peft's ParamWrapper (gate_up_proj at rank 2r, alpha 2 alpha; down_proj at rank r): the adapted
parameters are the attention layers' and the experts' (fp32 masters, every base weight and the routers frozen, the
routers found by routing replay unchanged); the merge equals peft's merge_and_unload for every tensor, bit for bit;
the adapter reloads; half of a fused pair is refused, and expert parallelism with expert LoRA is refused by rlsp.check.
"""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
from peft.tuners.lora import LoraLayer
from tiny_deepseek import deepseek_config
from tiny_linear import linear_config
from tiny_moe import EXACT_SHAPE, moe_config, write_tiny_moe
from torch import nn
from transformers import AutoModelForCausalLM

from rlsp.check import main as check_main
from rlsp.models.feature_support import lora_problem
from rlsp.models.lora import LoraSettings, apply_lora, apply_saved_lora_config, is_adapter_param
from rlsp.models.lora_experts import expert_parallel_problem

ATTN = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
MLA = {"self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
       "self_attn.o_proj"}
DENSE = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
SHARED = {"mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"}
# family: (config, the adapted leaf kinds under model.layers.N)
FAMILIES = {
    "qwen3_moe": (lambda: moe_config("qwen3_moe", **EXACT_SHAPE), ATTN),
    "mixtral": (lambda: moe_config("mixtral", **EXACT_SHAPE), ATTN),
    "olmoe": (lambda: moe_config("olmoe", **EXACT_SHAPE), ATTN),
    "glm4_moe": (lambda: moe_config("glm4_moe", **EXACT_SHAPE), ATTN | DENSE | SHARED),
    "deepseek_v3": (lambda: deepseek_config("v3"), MLA | DENSE | SHARED),
    "qwen3_next": (lambda: linear_config("qwen3_next"), ATTN | {s.replace("experts", "expert") for s in SHARED} |
                   {"mlp.shared_expert_gate", "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba",
                    "linear_attn.out_proj"}),
    "qwen2_moe": (lambda: moe_config("qwen2_moe", **EXACT_SHAPE), ATTN | {s.replace("experts", "expert") for s in SHARED}
                  | {"mlp.shared_expert_gate"}),
    "qwen3_5_moe_text": (lambda: linear_config("qwen3_5_moe_text"), ATTN | {s.replace("experts", "expert") for s in SHARED}
                         | {"mlp.shared_expert_gate", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
                            "linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.out_proj"}),
}
LORA = LoraSettings(rank=4, alpha=8.0)


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[family][0](), dtype=torch.float32)


def _random_b(lm: nn.Module) -> None:
    """peft starts B at zero, which would make every merge trivially the base."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _leaf_kinds(names) -> set[str]:
    return {re.sub(r"^model\.layers\.\d+\.", "", n) for n in names}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapted_layers_are_the_linears_never_experts_or_routers(family):
    lm = _model(family)
    linear = {n for n, m in lm.named_modules() if type(m) is nn.Linear and n != "lm_head"}
    adapters = apply_lora(lm, LORA)
    assert set(adapters.layers) == linear
    assert _leaf_kinds(adapters.layers) == FAMILIES[family][1]
    assert all(type(m.base_layer) is nn.Linear for m in adapters.layers.values())
    assert not [n for n, m in lm.named_modules() if isinstance(m, LoraLayer) and n not in adapters.layers]
    fused = [n for n, m in lm.named_modules() if type(m).__name__.endswith("Experts") or "Router" in type(m).__name__]
    assert fused and all(not any(a.startswith(f + ".") or a == f for a in adapters.layers) for f in fused)
    frozen = [p for n, p in lm.named_parameters() if any(n.startswith(f + ".") for f in fused)]
    assert frozen and not any(p.requires_grad for p in frozen)
    assert all(is_adapter_param(n) == p.requires_grad for n, p in lm.named_parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_merge_for_rollout_equals_peft_merge_and_unload(family):
    lm = _model(family)
    adapters = apply_lora(lm, LORA)
    _random_b(lm)
    merged = {k: v.clone() for k, v in adapters.merge_for_rollout(lm.named_parameters())}
    reference = dict(adapters.merged_lm().named_parameters())  # peft's merge_and_unload, in place
    assert merged.keys() == reference.keys()
    moved = [k for k in merged if not torch.equal(merged[k], _model(family).get_parameter(k))]
    assert _leaf_kinds(k.removesuffix(".weight") for k in moved) == FAMILIES[family][1]
    for name, t in merged.items():
        assert torch.equal(t, reference[name]), (name, float((t - reference[name]).abs().max()))


def test_saved_adapter_reloads_onto_the_same_layers(tmp_path):
    """Continue from a saved adapter (lora_adapter_path) and export's rebuild from adapter_config.json."""
    lm = _model("glm4_moe")
    adapters = apply_lora(lm, LORA)
    _random_b(lm)
    adapters.peft_model.save_pretrained(str(tmp_path))
    saved = {n: p.detach().clone() for n, p in lm.named_parameters() if is_adapter_param(n)}
    again = _model("glm4_moe")
    loaded = apply_lora(again, LoraSettings(rank=0, alpha=1.0, adapter_path=str(tmp_path)))
    assert set(loaded.layers) == set(adapters.layers)
    got = {n: p for n, p in again.named_parameters() if is_adapter_param(n)}
    assert got.keys() == saved.keys() and all(torch.equal(got[n], saved[n]) for n in saved)
    export = apply_saved_lora_config(_model("glm4_moe"), str(tmp_path))
    assert set(export.layers) == set(adapters.layers)
    assert isinstance(export.merged_lm(), type(lm)) and not any(isinstance(m, LoraLayer) for m in export.lm.modules())


@pytest.mark.parametrize("family,targets,refused,where", [
    ("deepseek_v3", ("o_proj", "gate"), "['gate']", "mlp.gate"),
    ("qwen3_moe", ("q_proj", "experts"), "['experts']", "mlp.experts"),
    ("qwen3_moe", ("q_proj", "w1"), "['w1']", "mlp.experts"),
])
def test_targets_naming_only_routers_or_the_experts_module_are_refused(family, targets, refused, where):
    with pytest.raises(ValueError, match=re.escape(f"{refused} name only the routers or the fused experts module of "
                                                   f"{family}") + f".*{re.escape(where)}"):
        apply_lora(_model(family), LoraSettings(rank=4, alpha=8.0, target_modules=targets))


@pytest.mark.parametrize("family,targets,half", [
    ("qwen3_moe", ("q_proj", "gate_proj", "down_proj"), "['gate_proj']"),
    ("mixtral", ("q_proj", "w3"), "['w3']"),
])
def test_half_of_a_fused_pair_is_refused(family, targets, half):
    with pytest.raises(ValueError, match=re.escape(f"{half} reach only part of model.layers.0.mlp.experts.gate_up_proj "
                                                   f"of {family}")):
        apply_lora(_model(family), LoraSettings(rank=4, alpha=8.0, target_modules=targets))


def test_gate_proj_on_glm4_moe_with_experts_excluded_reaches_its_dense_and_shared_mlps():
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=("gate_proj",), exclude_modules=("experts",))
    adapters = apply_lora(_model("glm4_moe"), settings)
    assert sorted(adapters.layers) == ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_experts.gate_proj"]
    assert adapters.experts == {}


def test_lora_problem_names_the_key_and_value():
    model = _section(lora_rank=8)
    config = FAMILIES["qwen3_moe"][0]()
    assert lora_problem(config, model) is None  # all-linear: the attention layers
    model.target_modules = ["q_proj", "down_proj"]
    assert lora_problem(config, model) is None  # down_proj: the experts' fused down_proj
    model.target_modules = ["q_proj", "up_proj"]
    problem = lora_problem(config, model)
    assert problem.startswith("target_modules=['q_proj', 'up_proj']: ['up_proj'] reach only part of"), problem


EXPERT_TARGETS = {"qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                  "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3")}


def _expert_lora(family: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, object]:
    lm = _model(family).to(dtype)
    return lm, apply_lora(lm, LoraSettings(rank=4, alpha=8.0, target_modules=EXPERT_TARGETS[family]))


@pytest.mark.parametrize("family", sorted(EXPERT_TARGETS))
def test_expert_targets_adapt_attention_and_the_fused_experts(family):
    from rlsp.engine.router_replay import check_replayable

    lm, adapters = _expert_lora(family, torch.bfloat16)
    layers = [f"model.layers.{i}" for i in range(2)]
    assert {n for n in adapters.layers if "experts" not in n} == {f"{lay}.{a}" for lay in layers for a in ATTN}
    assert sorted(e.param for e in adapters.experts.values()) == \
        sorted(f"{lay}.mlp.experts.{p}" for lay in layers for p in ("down_proj", "gate_up_proj"))
    shapes = {n: tuple(p.shape) for n, p in lm.named_parameters() if n.startswith("model.layers.0.mlp.experts.")}
    assert shapes == {  # E=4 experts, H=48, I=32; gate_up_proj at rank 2r=8, down_proj at r=4
        "model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj": (4, 64, 48),
        "model.layers.0.mlp.experts.base_layer.base_layer.down_proj": (4, 48, 32),
        "model.layers.0.mlp.experts.base_layer.lora_A.default.weight": (32, 48),
        "model.layers.0.mlp.experts.base_layer.lora_B.default.weight": (64, 32),
        "model.layers.0.mlp.experts.lora_A.default.weight": (16, 32),
        "model.layers.0.mlp.experts.lora_B.default.weight": (48, 16)}
    assert all(e.scaling == 2.0 for e in adapters.experts.values())  # alpha / r for both
    assert all(is_adapter_param(n) == p.requires_grad for n, p in lm.named_parameters())
    assert all(p.dtype == (torch.float32 if is_adapter_param(n) else torch.bfloat16) for n, p in lm.named_parameters())
    assert expert_parallel_problem(lm).startswith("LoRA on the fused experts (model.layers.0.mlp.experts, ...: 2 layers)"
                                                  " is not supported with expert parallelism")
    assert expert_parallel_problem(_model(family)) is None  # what the engine checks before expert parallelism
    routers = check_replayable(lm)  # routing replay and the aux loss find the same, unadapted routers
    assert list(routers) == list(check_replayable(_model(family))) and all(
        not isinstance(m, LoraLayer) and not any(p.requires_grad for p in m.parameters()) for m in routers.values())


@pytest.mark.parametrize("family", sorted(EXPERT_TARGETS))
def test_expert_merge_for_rollout_equals_peft_merge_and_unload(family):
    lm, adapters = _expert_lora(family)
    _random_b(lm)
    merged = {k: v.clone() for k, v in adapters.merge_for_rollout(lm.named_parameters())}
    reference = dict(adapters.merged_lm().named_parameters())  # peft's merge_and_unload, in place
    assert merged.keys() == reference.keys()
    base = _model(family)
    moved = {k for k in merged if not torch.equal(merged[k], base.get_parameter(k))}
    assert _leaf_kinds(moved) == {f"{a}.weight" for a in ATTN} | {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    for name, t in merged.items():
        assert torch.equal(t, reference[name]), (name, float((t - reference[name]).abs().max()))


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(EXPERT_TARGETS)))
def test_expert_merge_equals_peft_on_the_other_families(family):
    """deepseek_v3, glm4_moe, olmoe, qwen3_next: o_proj, the dense / shared MLPs and the fused experts."""
    lm = _model(family)
    adapters = apply_lora(lm, LoraSettings(rank=4, alpha=8.0, target_modules=("o_proj", "gate_proj", "up_proj",
                                                                             "down_proj")))
    assert len(adapters.experts) == 2 * sum(".experts" in n and n.endswith("experts") for n, _ in lm.named_modules())
    _random_b(lm)
    merged = {k: v.clone() for k, v in adapters.merge_for_rollout(lm.named_parameters())}
    reference = dict(adapters.merged_lm().named_parameters())
    assert merged.keys() == reference.keys() and all(torch.equal(t, reference[k]) for k, t in merged.items())


def test_saved_expert_adapter_continues_and_exports(tmp_path):
    """lora_adapter_path on a saved expert adapter (accepted by rlsp.check), and export's rebuild from its config."""
    lm, adapters = _expert_lora("qwen3_moe")
    _random_b(lm)
    adapters.peft_model.save_pretrained(str(tmp_path))
    saved = {n: p.detach().clone() for n, p in lm.named_parameters() if is_adapter_param(n)}
    assert lora_problem(FAMILIES["qwen3_moe"][0](), _section(lora_rank=4, lora_adapter_path=str(tmp_path))) is None
    again = _model("qwen3_moe")
    loaded = apply_lora(again, LoraSettings(rank=4, alpha=8.0, adapter_path=str(tmp_path)))
    assert set(loaded.layers) == set(adapters.layers) and loaded.experts.keys() == adapters.experts.keys()
    got = {n: p for n, p in again.named_parameters() if is_adapter_param(n)}
    assert got.keys() == saved.keys() and all(torch.equal(got[n], saved[n]) and got[n].requires_grad for n in saved)
    export = apply_saved_lora_config(_model("qwen3_moe"), str(tmp_path))
    assert export.experts == adapters.experts and not any(isinstance(m, LoraLayer) for m in export.merged_lm().modules())


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("moe_lora")
    rows = [{"data_source": "rlsp/arithmetic", "prompt": [{"role": "user", "content": "1+1"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}} for i in range(4)]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    return write_tiny_moe("qwen3_moe", str(root / "model")), str(root / "train.parquet")


@pytest.mark.parametrize("targets,extra,refused", [
    ("all-linear", [], None),
    ("[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]", [], None),
    ("[q_proj,v_proj,gate_proj]", [], "actor_rollout_ref.model.target_modules=['q_proj', 'v_proj', 'gate_proj']: "
                                      "['gate_proj'] reach only part of"),
    ("[q_proj,down_proj]", [f"actor_rollout_ref.{role}.fsdp_config.expert_parallel_size=2" for role in ("actor", "ref")],
     "actor_rollout_ref.model.target_modules=['q_proj', 'down_proj'] adapts the fused experts of qwen3_moe, and "
     "expert_parallel_size=2"),
])
def test_check_of_a_tiny_qwen3_moe_lora_run(tmp_path, qwen3_moe_dir, capsys, targets, extra, refused):
    path, train = qwen3_moe_dir
    rc = check_main([*extra, "trainer.device=cpu", f"trainer.cache_dir={tmp_path / 'cache'}",
                     f"trainer.default_local_dir={tmp_path / 'run'}", f"data.train_files={train}", "data.val_files=null",
                     "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=hf",
                     f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.model.lora_rank=8",
                     f"actor_rollout_ref.model.target_modules={targets}"])
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  - ")]
    if refused is None:
        assert rc == 0 and problems == [], problems
    else:
        assert rc != 0 and len(problems) == 1 and refused in problems[0], problems


def _section(**values):
    from omegaconf import OmegaConf

    from rlsp.config.schema import RLSPConfig

    model = OmegaConf.structured(RLSPConfig).actor_rollout_ref.model
    for key, value in values.items():
        setattr(model, key, value)
    return model


def test_peft_adapter_on_fused_experts_is_refused(tmp_path):
    """An adapter peft made on transformers 5 with all-linear (ParamWrapper on experts and router)."""
    from peft import LoraConfig, get_peft_model

    get_peft_model(_model("qwen3_moe"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")).save_pretrained(
        str(tmp_path))
    with pytest.raises(ValueError, match=r"lora_adapter_path=.*adapts parameters \['gate.weight'\], which are no "
                                         r"fused expert parameter of qwen3_moe"):
        apply_lora(_model("qwen3_moe"), LoraSettings(rank=0, alpha=1.0, adapter_path=str(tmp_path)))
    problem = lora_problem(FAMILIES["qwen3_moe"][0](), _section(lora_rank=4, lora_adapter_path=str(tmp_path)))
    assert problem.startswith(f"lora_adapter_path={str(tmp_path)!r}: its adapter_config.json adapts parameters")


def test_adapter_with_per_expert_tensors_is_refused(tmp_path):
    """An adapter trained on per-expert linears (transformers 4 names) whose config also reaches nn.Linear layers."""
    from safetensors.torch import load_file, save_file

    lm = _model("glm4_moe")
    apply_lora(lm, LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "gate_proj", "up_proj"))
               ).peft_model.save_pretrained(str(tmp_path))
    assert lora_problem(FAMILIES["glm4_moe"][0](), _section(lora_rank=4, lora_adapter_path=str(tmp_path))) is None
    file = tmp_path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    tensors["base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_A.weight"] = torch.zeros(4, 48)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=r"1 of its adapted layers \(model\.layers\.1\.mlp\.experts\.0\.gate_proj\) "
                                         r"are no layer rlsp adapts on glm4_moe"):
        apply_lora(_model("glm4_moe"), LoraSettings(rank=0, alpha=1.0, adapter_path=str(tmp_path)))
    # rlsp.check reads the adapter too when only lora_adapter_path is set (lora_rank 0: the adapter decides)
    from rlsp.models.feature_support import feature_errors

    errors = feature_errors(FAMILIES["glm4_moe"][0](), _section(lora_rank=0, lora_adapter_path=str(tmp_path)), "m.")
    assert len(errors) == 1 and errors[0].startswith(f"m.lora_adapter_path={str(tmp_path)!r}: 1 of its adapted"), errors
