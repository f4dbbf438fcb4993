"""Which layers LoRA adapts on the MoE families whose experts transformers 5 fuses into 3-D parameters.

On qwen3_moe, mixtral, olmoe, glm4_moe, deepseek_v3/v2, qwen3_next, qwen2_moe and qwen3_5_moe_text a MoE layer's
experts are one module holding `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I], and its router (`mlp.gate`) is a custom module,
not an `nn.Linear`. peft's transformers v4 -> v5 config conversion rewrites the MLP names of `target_modules`
(gate_proj/up_proj/down_proj, mixtral's w1/w2/w3, the router's `gate`) onto those parameters as `ParamWrapper`
adapters, and in doing so drops the same names from every *linear* layer: a dense first layer's MLP and the shared
experts lose their adapters, while the router gains one (so routing would drift from what the rollout serves).
verl hands `all-linear` to peft on the HF model, so on transformers 5 it gets exactly that conversion.

rlsp resolves the targets itself. `resolve_targets` turns the run's `target_modules` / `exclude_modules` (peft's
matching rules: `all-linear`, a regex matched against the whole module name, or a list of names matched as the name
or its dotted suffix) into the exact `nn.Linear` modules to adapt -- attention (MLA's and Gated DeltaNet's
projections included), dense layers' MLPs, shared experts and their output gate (`shared_expert_gate`, which scales
the shared expert and routes nothing) -- and, for a list that names the expert projections (gate_proj/up_proj/
down_proj; mixtral's w1/w3/w2; or the fused names), the fused expert parameters (rlsp.models.lora_experts: peft's
`target_parameters`). `all-linear` adapts the `nn.Linear` layers only: it never reaches the experts. The routers are
never adapted; a list entry that reaches only a router (or the experts module by its own name) is refused by name.
`apply_lora` hands peft those exact names on `PeftBase`, a view of the model without its HF config, so peft's
conversion (meant for adapters trained on transformers 4) does not rewrite them.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import nn

from rlsp.config.lora_keys import LORA_ALL_LINEAR, LORA_REFUSED_TARGETS
from rlsp.models.feature_support import LORA_FUSED_EXPERT_FAMILIES, moe_setting
from rlsp.models.lora_experts import (
    FUSED_PARAMS,
    expert_rank_patterns,
    expert_spellings,
    experts_modules,
    resolve_expert_targets,
)

# names under a fused experts module that a target may spell (any family's transformers 4 names and the fused ones):
# those that are not the family's own spellings (rlsp.models.lora_experts) are refused by name
EXPERT_TARGET_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate_up_proj")


def fused_expert_family(config: Any) -> bool:
    """True when the model of `config` has fused experts whose targets peft's conversion would rewrite."""
    return getattr(config, "model_type", None) in LORA_FUSED_EXPERT_FAMILIES and moe_setting(config) is not None


class PeftBase(nn.Module):
    """`lm`'s children under their own names (so every module and parameter name is the HF name), without `lm`'s
    config: peft then injects exactly the listed targets. The layers are shared, so `lm` holds the adapters. Its
    `name_or_path` is `lm`'s, which peft writes as the adapter's base model."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        for name, child in lm.named_children():
            self.add_module(name, child)
        self.name_or_path = getattr(lm, "name_or_path", "")


def _matches(spec: str | list[str] | tuple[str, ...], name: str) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in spec)


def _linear_names(lm: nn.Module) -> list[str]:
    refused = tuple(f".{t}" for t in LORA_REFUSED_TARGETS)
    return [name for name, m in lm.named_modules()
            if type(m) is nn.Linear and name not in LORA_REFUSED_TARGETS and not name.endswith(refused)]


def _expert_and_router_modules(lm: nn.Module) -> list[str]:
    return [name for name, m in lm.named_modules()
            if type(m).__name__.endswith("Experts") or "Router" in type(m).__name__]


def _expert_or_router_names(lm: nn.Module) -> list[tuple[str, str]]:
    """(name a target may match, the module it reaches): the fused experts' and the routers' modules, and the
    transformers 4 names peft's conversion maps onto the experts (`...experts.gate_proj`, mixtral's `...experts.w1`)."""
    names = []
    for name in _expert_and_router_modules(lm):
        names.append((name, name))
        if name.endswith("experts"):
            names += [(f"{name}.{t}", name) for t in EXPERT_TARGET_NAMES]
    return names


@dataclass(frozen=True)
class LoraTargets:
    """What LoRA adapts on one of these models: `nn.Linear` modules and fused expert parameters (full names)."""

    linear: list[str]
    experts: list[str]

    def peft_config(self, config: Any, rank: int, alpha: float) -> Any:
        """peft's LoraConfig `config` (for the linear targets) with the expert parameters as `target_parameters`."""
        if self.experts:
            config.target_parameters = list(self.experts)
            config.rank_pattern, config.alpha_pattern = expert_rank_patterns(rank, alpha, self.experts)
        return config


def _refuse_router_targets(lm: nn.Module, target_modules: Any, linear: list[str]) -> None:
    spellings = expert_spellings(lm.config.model_type)
    fused = [f"{m}.{n}" for m in experts_modules(lm) for names in spellings.values() for n in names]
    missed = [t for t in target_modules if not any(_matches([t], n) for n in [*linear, *fused])]
    hits = {t: next((m for n, m in _expert_or_router_names(lm) if _matches([t], n)), None) for t in missed}
    if only := {t: n for t, n in hits.items() if n is not None}:
        reached = ", ".join(sorted(set(only.values())))
        raise ValueError(
            f"actor_rollout_ref.model.target_modules={list(target_modules)!r}: {list(only)} name only the routers or "
            f"the fused experts module of {lm.config.model_type} ({reached}), which rlsp's LoRA does not adapt as such "
            f"(routing must stay what the rollout serves); legal: drop them; the fused experts take "
            f"{sorted({n for names in spellings.values() for n in names})}; {LORA_ALL_LINEAR}: attention, dense MLPs "
            "and shared experts")


def _chosen_linear(lm: nn.Module, target_modules: Any, exclude_modules: Any) -> list[str]:
    linear = _linear_names(lm)
    if not isinstance(target_modules, str):
        _refuse_router_targets(lm, target_modules, linear)
    wanted = linear if target_modules == LORA_ALL_LINEAR else [n for n in linear if _matches(target_modules, n)]
    return [n for n in wanted if not (exclude_modules and _matches(exclude_modules, n))]


def resolve_targets(lm: nn.Module, target_modules: str | tuple[str, ...] | list[str],
                    exclude_modules: str | tuple[str, ...] | list[str] | None) -> LoraTargets:
    """The `nn.Linear` modules and fused expert parameters of `lm` that the run's targets select (see the module
    docstring); ValueError for a list entry that reaches only a router or the experts module itself, for half of a
    fused projection pair, or when nothing is selected."""
    linear = _linear_names(lm)
    chosen = _chosen_linear(lm, target_modules, exclude_modules)
    experts = resolve_expert_targets(lm, target_modules, exclude_modules)
    if not chosen and not experts:
        raise ValueError(f"actor_rollout_ref.model.target_modules={target_modules!r} (exclude_modules="
                         f"{exclude_modules!r}) selects no nn.Linear layer of {lm.config.model_type}; legal: "
                         f"{LORA_ALL_LINEAR}, or names among {sorted({n.rsplit('.', 1)[-1] for n in linear})}")
    return LoraTargets(chosen, experts)


def describe_targets(lm: nn.Module, targets: LoraTargets) -> str:
    """One line for the start-up log: which layers carry adapters and which stay without."""
    def counted(names: list[str]) -> str:
        kinds = Counter(re.sub(r"\.\d+\.", ".N.", n) for n in names)
        return ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "none"

    routers = [n for n in _expert_and_router_modules(lm) if not n.endswith("experts")]
    return (f"LoRA on {lm.config.model_type}: {len(targets.linear)} nn.Linear layers adapted "
            f"({counted(targets.linear)}); fused expert parameters adapted: {counted(targets.experts)}; "
            f"no adapters on the routers ({counted(routers)})")


def _wrapper_names(lm: nn.Module, params: list[str]) -> set[str]:
    """The module names peft's nested ParamWrappers take for the fused expert parameters `params`: on each experts
    module the first registered parameter is the innermost wrapper (one `.base_layer` per wrapper around it)."""
    out = set()
    for module in experts_modules(lm):
        mine = [p for p in FUSED_PARAMS if f"{module}.{p}" in params]
        out |= {module + ".base_layer" * (len(mine) - 1 - i) for i in range(len(mine))}
    return out


def saved_adapter_problem(lm: nn.Module, adapter_path: str) -> str | None:
    """Why the PEFT adapter at `adapter_path` cannot continue on `lm` (one of these families), or None: its
    `target_parameters` must be fused expert parameters (never a router's weight), and every tensor it holds must
    land on an adapter peft builds from its config on `PeftBase` (not per-expert tensors of a transformers 4 adapter)."""
    from peft import LoraConfig  # noqa: PLC0415 -- LoRA runs only
    from safetensors import safe_open  # noqa: PLC0415

    config = LoraConfig.from_pretrained(adapter_path)
    fused = [f"{m}.{p}" for m in experts_modules(lm) for p in FUSED_PARAMS]
    wanted = sorted(config.target_parameters or [])
    hit = {t: [n for n, _ in lm.named_parameters() if n == t or n.endswith(f".{t}")] for t in wanted}
    params = [n for names in hit.values() for n in names]
    if bad := [t for t, names in hit.items() if not names or any(n not in fused for n in names)]:
        return (f"its adapter_config.json adapts parameters {bad}, which are no fused expert parameter of "
                f"{lm.config.model_type} ({', '.join(FUSED_PARAMS)} of the experts; rlsp never adapts a router); "
                "legal: an adapter on nn.Linear layers and the fused experts")
    try:
        linear = _chosen_linear(lm, config.target_modules or [], config.exclude_modules) if config.target_modules \
            else []
    except ValueError as exc:
        return f"its adapter_config.json: {str(exc).removeprefix('actor_rollout_ref.model.')}"
    file = os.path.join(adapter_path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        return None
    with safe_open(file, "pt") as f:
        saved = {k.removeprefix("base_model.model.").split(".lora_")[0] for k in f.keys()}
    if extra := sorted(saved - set(linear) - _wrapper_names(lm, params)):
        return (f"{len(extra)} of its adapted layers ({', '.join(extra[:3])}) are no layer rlsp adapts on "
                f"{lm.config.model_type} (nn.Linear layers and the fused experts' {list(FUSED_PARAMS)} as peft "
                "wraps them; per-expert linears are a transformers 4 layout); legal: an adapter saved by rlsp or by "
                "peft on transformers 5")
    return None


def _meta_model(config: Any) -> nn.Module:
    import torch  # noqa: PLC0415 -- rlsp.check imports this module; only a LoRA run on these families builds a model
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def target_problem(config: Any, model: Any) -> str | None:
    """`resolve_targets`' or `saved_adapter_problem`'s refusal for the run's `model` section on the model of
    `config` (built on the meta device: no weights), naming the key; or None."""
    def names(v: Any) -> Any:
        return v if v is None or isinstance(v, str) else tuple(v)

    lm = _meta_model(config)
    if path := getattr(model, "lora_adapter_path", None):
        problem = saved_adapter_problem(lm, str(path))
        return None if problem is None else f"lora_adapter_path={str(path)!r}: {problem}"
    try:
        resolve_targets(lm, names(model.target_modules), names(getattr(model, "exclude_modules", None)))
    except ValueError as exc:
        return str(exc).removeprefix("actor_rollout_ref.model.")
    return None


def expert_parallel_lora_problem(config: Any, model: Any, ep: int) -> str | None:
    """With expert parallelism (`ep` > 1), LoRA that reaches the fused experts of the model of `config` (the run's
    targets, or a saved adapter's target_parameters) is refused, naming the keys; None otherwise."""
    if ep <= 1 or not fused_expert_family(config):
        return None
    lm = _meta_model(config)
    if path := getattr(model, "lora_adapter_path", None):
        from peft import LoraConfig  # noqa: PLC0415 -- LoRA runs only

        experts = sorted(LoraConfig.from_pretrained(str(path)).target_parameters or [])
        key = f"lora_adapter_path={str(path)!r} (target_parameters {experts})"
    else:
        excl = model.exclude_modules if model.exclude_modules is None or isinstance(model.exclude_modules, str) \
            else list(model.exclude_modules)
        targets = model.target_modules if isinstance(model.target_modules, str) else list(model.target_modules)
        try:
            experts = resolve_expert_targets(lm, targets, excl)
        except ValueError:
            return None  # the target check names it
        key = f"target_modules={targets!r}"
    if not experts:
        return None
    return (f"{key} adapts the fused experts of {config.model_type}, and expert_parallel_size={ep}: LoRA on the fused "
            "experts is not supported with expert parallelism (each rank keeps only its experts' slice of the base "
            "weights, peft's adapter factors span every expert); legal: expert_parallel_size=1, or target_modules "
            "without the expert projections")
