"""LoRA on the fused experts of the MoE families transformers 5 fuses, with peft's own `ParamWrapper`.

A MoE layer's experts module holds `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]. An explicit
`target_modules` list naming the expert projections adapts these parameters, as peft's transformers v4 -> v5
conversion does for the same names: gate_proj + up_proj (mixtral: w1 + w3; or the fused name `gate_up_proj`) adapt
`gate_up_proj` with rank 2r and alpha 2 alpha (the scale alpha / r of the two projections it fuses), down_proj
(mixtral: w2) adapts `down_proj` with rank r. Naming only one half of the fused pair is refused (peft refuses it
too); `exclude_modules` matching the experts module, its parameter or a projection name leaves that layer's experts
unadapted. `all-linear` never adapts the experts, and the routers are never adapted (rlsp.models.lora_targets).

peft wraps the experts module once per targeted parameter (`ParamWrapper`, nested: the first parameter the module
registers, gate_up_proj, is the inner one), so its names become `...experts.base_layer.base_layer.gate_up_proj`,
`...experts.base_layer.lora_A.default.weight` [E*2r, H] (gate_up_proj's adapter), `...experts.lora_A.default.weight`
[E*r, I] (down_proj's) and so on; during a forward the wrapper adds scale * B_e @ A_e to expert e's weight through a
parametrization. `ExpertAdapter` records one wrapper, and `merge_expert` folds it into the full 3-D tensor exactly as
peft's `merge_and_unload` computes it (the same einsum), under the fused parameter's own name.

Legend: E experts, O / I a fused parameter's output / input features (per expert), R = E * rank.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

FUSED_PARAMS = ("gate_up_proj", "down_proj")
# the transformers 4 per-expert linears each fused parameter replaces, by family (peft's conversion mapping)
V4_NAMES = {"mixtral": {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}}
DEFAULT_V4_NAMES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
FUSED_PATTERN = {"gate_up_proj": r"experts\.gate_up_proj"}  # rank_pattern / alpha_pattern key (peft's own rule)


def _matches(spec: Any, name: str) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in spec)


def experts_modules(lm: nn.Module) -> list[str]:
    """Names of the fused experts modules (those holding both FUSED_PARAMS as 3-D parameters)."""
    return [name for name, m in lm.named_modules() if type(m).__name__.endswith("Experts")
            and all(getattr(getattr(m, p, None), "ndim", 0) == 3 for p in FUSED_PARAMS)]


def expert_spellings(model_type: str) -> dict[str, tuple[str, ...]]:
    """Per fused parameter, the target names that adapt it on `model_type` (the v4 names, then its own name)."""
    return {p: (*V4_NAMES.get(model_type, DEFAULT_V4_NAMES)[p], p) for p in FUSED_PARAMS}


def _reached(entry: str, module: str, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if _matches([entry], f"{module}.{n}")]


def resolve_expert_targets(lm: nn.Module, target_modules: Any, exclude_modules: Any) -> list[str]:
    """Full names of the fused expert parameters a target list adapts (see the module docstring; [] for
    `all-linear` or a regex); ValueError when it names one half of gate_up_proj's fused pair."""
    if isinstance(target_modules, str):
        return []
    spellings = expert_spellings(lm.config.model_type)
    chosen = []
    for module in experts_modules(lm):
        for param, names in spellings.items():
            hit = {n for t in target_modules for n in _reached(t, module, names)}
            if not hit or (exclude_modules and any(_matches(exclude_modules, n) for n in
                                                   (module, f"{module}.{param}", *(f"{module}.{v}" for v in names)))):
                continue
            if param not in hit and len(hit) < len(names) - 1:
                pair = list(names[:-1])
                raise ValueError(
                    f"actor_rollout_ref.model.target_modules={list(target_modules)!r}: {sorted(hit)} reach only part "
                    f"of {module}.{param} of {lm.config.model_type}, which fuses {pair} into one parameter; legal: "
                    f"name all of {pair} (or {param!r}), or exclude_modules=['experts'] to leave the fused experts "
                    "unadapted")
            chosen.append(f"{module}.{param}")
    return chosen


def expert_rank_patterns(rank: int, alpha: float, chosen: list[str]) -> tuple[dict[str, int], dict[str, float]]:
    """peft's rank_pattern / alpha_pattern for `chosen`: gate_up_proj at rank 2r and alpha 2 alpha (its two fused
    projections' rank r and scale alpha / r), as peft's v4 -> v5 conversion sets them."""
    if not any(c.endswith(".gate_up_proj") for c in chosen):
        return {}, {}
    key = FUSED_PATTERN["gate_up_proj"]
    return {key: 2 * rank}, {key: 2 * alpha}


@contextlib.contextmanager
def expert_pattern_warning_off() -> Iterator[None]:
    """peft warns that a rank_pattern / alpha_pattern key matched no targeted *module* even when it applied it to a
    targeted parameter (gate_up_proj's rank 2r is set, as the adapter shapes show): drop that false warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match any targeted "
                                "module and were ignored: " + re.escape(str([FUSED_PATTERN["gate_up_proj"]])),
                                category=RuntimeWarning)
        yield


def canonical_name(name: str) -> str:
    """The HF name of a parameter under peft's wrappers (every `.base_layer` segment removed)."""
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".", 1)
    return name


@dataclass(frozen=True)
class ExpertAdapter:
    """One peft ParamWrapper on a fused expert parameter: its adapter tensors' names and how peft folds them."""

    param: str  # the fused parameter's HF name (`...experts.gate_up_proj`)
    lora_a: str  # full name of lora_A's weight [R, I]
    lora_b: str  # full name of lora_B's weight [O, R]
    num_experts: int
    swapped: bool  # peft's `_did_swap_in_out_features`: the parameter is stored [E, O, I]
    scaling: float


def expert_adapters(lm: nn.Module, adapter: str) -> dict[str, ExpertAdapter]:
    """{full name of the wrapped base parameter: its ExpertAdapter} for every ParamWrapper in `lm`; ValueError for
    one on anything but a fused experts module's FUSED_PARAMS (e.g. a router's weight)."""
    out = {}
    for name, m in lm.named_modules():
        if type(m).__name__ != "ParamWrapper":
            continue
        base = m.get_base_layer()
        if not type(base).__name__.endswith("Experts") or m.parameter_name not in FUSED_PARAMS or m.num_experts < 2:
            raise ValueError(f"a LoRA adapter on {name}.{m.parameter_name} ({type(base).__name__}): rlsp adapts the "
                             f"fused experts' {list(FUSED_PARAMS)} only (never a router or another parameter)")
        inner = next(n for n, p in lm.named_parameters() if p is getattr(base, m.parameter_name))
        out[inner] = ExpertAdapter(canonical_name(inner), f"{name}.lora_A.{adapter}.weight",
                                   f"{name}.lora_B.{adapter}.weight", int(m.num_experts),
                                   bool(m._did_swap_in_out_features), float(m.scaling[adapter]))
    return out


def merge_expert(e: ExpertAdapter, w_EOI: torch.Tensor, a_RI: torch.Tensor, b_OR: torch.Tensor) -> torch.Tensor:
    """`w` + scale * B_e @ A_e per expert, in fp32, computed as peft's ParamWrapper.get_delta_weight does (so a fp32
    model merges bit for bit like merge_and_unload)."""
    a_ErI = a_RI.float().reshape(e.num_experts, -1, a_RI.shape[-1])
    b_OrE = b_OR.float().reshape(b_OR.shape[0], -1, e.num_experts)
    spec = "o r e, e r i -> e o i" if e.swapped else "o r e, e r i -> e i o"
    return w_EOI.float() + torch.einsum(spec, b_OrE, a_ErI) * e.scaling


def expert_parallel_problem(lm: nn.Module) -> str | None:
    """Why `lm` with LoRA on its fused experts cannot run with expert parallelism, or None without such adapters."""
    wrapped = sorted({re.sub(r"(\.base_layer)+$", "", n) for n, m in lm.named_modules()
                      if type(m).__name__ == "ParamWrapper"})
    if not wrapped:
        return None
    return (f"LoRA on the fused experts ({wrapped[0]}, ...: {len(wrapped)} layers) is not supported with expert "
            "parallelism (each rank would keep its own experts' slice of the base weights but peft's adapter factors "
            "for every expert); legal: expert_parallel_size=1, or target_modules without the expert projections")
