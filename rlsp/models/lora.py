"""LoRA adapters on the policy with `peft`: inject them, name them, switch them off, merge them for rollouts.

`apply_lora(lm, settings)` turns the targeted `nn.Linear` layers of a HF causal LM (of a vision-language model's
language model only, never its vision tower: rlsp.models.vision_lora) into peft LoRA layers *in place* (the LM
keeps its HF parameter tree, so FSDP2, Ulysses/ring attention and the vocab-chunked logprob head run on it unchanged)
and freezes everything but the adapters. peft renames what it wraps: `...q_proj.weight` becomes
`...q_proj.base_layer.weight` next to
`...q_proj.lora_A.default.weight` [r, in] and `...q_proj.lora_B.default.weight` [out, r]; the layer
computes `base(x) + scale * B(A(x))` with scale = alpha / r. On the MoE families whose experts transformers 5
fuses (qwen3_moe, mixtral, olmoe, glm4_moe, deepseek_v3/v2, qwen3_next, qwen2_moe, qwen3_5_moe_text) rlsp resolves the targets itself and keeps
peft's v4 -> v5 conversion off them (rlsp.models.lora_targets): nn.Linear layers, plus the fused expert parameters
(peft's ParamWrapper, rlsp.models.lora_experts) when the target list names the expert projections; never a router.

The returned `LoraAdapters` handle gives what the rest of rlsp needs from peft:
- `adapters_disabled()`: the base model in the same module (the reference policy, no second copy);
- `merge_for_rollout(named)`: turns a stream of full (gathered) HF-named tensors into base-named
  weights with `W + scale * B @ A` folded in, one layer at a time, for the rollout engine;
- `peft_model`: peft's own view (`save_pretrained`) and `merged_lm()` (peft's merge_and_unload) for exports.

The adapters' master weights are fp32 whatever the base dtype (base weights may stay in the compute
dtype: they are frozen). Dropout on the adapter input is off: the rollout engine samples from the
merged weights, which must be the function the trainer differentiates.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlsp.config.lora_keys import LORA_ALL_LINEAR, LORA_REFUSED_TARGETS
from rlsp.models.lora_experts import expert_adapters, expert_pattern_warning_off, merge_expert
from rlsp.models.lora_targets import (
    PeftBase,
    describe_targets,
    fused_expert_family,
    resolve_targets,
    saved_adapter_problem,
)
from rlsp.models.vision_lora import refuse_tower_adapters, tower_excluded
from rlsp.utils.logging import get_logger

if TYPE_CHECKING:  # peft is imported where LoRA is used: runs without it never pay for the import
    from peft import LoraConfig, PeftModel

ADAPTER = "default"  # peft's adapter name; rlsp trains one adapter
LORA_ADAPTER_DIR = "lora_adapter"  # where a checkpoint's HF assets and an export keep the PEFT adapter
_BASE, _A, _B = ".base_layer.", f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."


@dataclass(frozen=True)
class LoraSettings:
    """What `actor_rollout_ref.model.lora_*` asks for (verl's keys)."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...] = LORA_ALL_LINEAR
    exclude_modules: str | tuple[str, ...] | None = None
    adapter_path: str | None = None  # continue from a saved PEFT adapter (its config decides rank/targets)


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """HF name of a parameter as the unwrapped model spells it (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(_BASE, ".")


def _peft_config(s: LoraSettings, task_type: str | None = "CAUSAL_LM") -> LoraConfig:
    from peft import LoraConfig  # noqa: PLC0415 -- see the TYPE_CHECKING import

    targets = s.target_modules if isinstance(s.target_modules, str) else list(s.target_modules)
    exclude = s.exclude_modules if s.exclude_modules is None or isinstance(s.exclude_modules, str) \
        else list(s.exclude_modules)
    return LoraConfig(r=s.rank, lora_alpha=s.alpha, target_modules=targets, exclude_modules=exclude,
                      lora_dropout=0.0, bias="none", task_type=task_type)


def apply_lora(lm: nn.Module, s: LoraSettings) -> LoraAdapters:
    """Wrap `lm`'s targeted linear layers with trainable LoRA adapters in place (new ones, or the
    adapter saved at `s.adapter_path`); every other parameter is frozen."""
    from peft import PeftModel, get_peft_model  # noqa: PLC0415 -- see the TYPE_CHECKING import

    if s.adapter_path:
        with expert_pattern_warning_off():
            peft_model = PeftModel.from_pretrained(_continued_base(lm, s.adapter_path), s.adapter_path,
                                                   is_trainable=True)
        if s.rank and peft_model.peft_config[ADAPTER].r != s.rank:
            raise ValueError(f"actor_rollout_ref.model.lora_rank={s.rank} but the adapter at {s.adapter_path!r} has "
                             f"rank {peft_model.peft_config[ADAPTER].r}; set lora_rank to it (or 0: the adapter decides)")
    else:  # a vision-language model: its language model only (rlsp.models.vision_lora)
        s = replace(s, exclude_modules=tower_excluded(lm, s.exclude_modules))
        with expert_pattern_warning_off():
            peft_model = get_peft_model(*_peft_target(lm, s), autocast_adapter_dtype=True)
    return LoraAdapters(peft_model, lm)


def _peft_base(lm: nn.Module) -> nn.Module:
    """What peft wraps: `lm`, or on the fused-expert MoE families its config-less view (rlsp.models.lora_targets)."""
    return PeftBase(lm) if fused_expert_family(getattr(lm, "config", None)) else lm


def _continued_base(lm: nn.Module, adapter_path: str) -> nn.Module:
    """`_peft_base`, after checking on the fused-expert MoE families that the saved adapter adapts nn.Linear layers only."""
    if fused_expert_family(getattr(lm, "config", None)) and (problem := saved_adapter_problem(lm, adapter_path)):
        raise ValueError(f"actor_rollout_ref.model.lora_adapter_path={adapter_path!r}: {problem}")
    return _peft_base(lm)


def _peft_target(lm: nn.Module, s: LoraSettings) -> tuple[nn.Module, LoraConfig]:
    """peft's model and config for `s`: on the fused-expert MoE families the exact nn.Linear layers to adapt,
    logged once at start-up (rlsp.models.lora_targets); elsewhere `s` as peft reads it."""
    if not fused_expert_family(getattr(lm, "config", None)):
        return lm, _peft_config(s)
    targets = resolve_targets(lm, s.target_modules, s.exclude_modules)
    get_logger("rlsp.models.lora").info(describe_targets(lm, targets))
    config = _peft_config(replace(s, target_modules=tuple(targets.linear), exclude_modules=None), task_type=None)
    return PeftBase(lm), targets.peft_config(config, s.rank, s.alpha)  # + the fused experts (rlsp.models.lora_experts)


def apply_saved_lora_config(lm: nn.Module, config_dir: str) -> LoraAdapters:
    """`apply_lora` with the adapter_config.json under `config_dir` (fresh adapter weights: an export
    fills them from a checkpoint)."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 -- see the TYPE_CHECKING import

    with expert_pattern_warning_off():
        return LoraAdapters(get_peft_model(_peft_base(lm), LoraConfig.from_pretrained(config_dir)), lm)


class LoraAdapters:
    """peft's view of a LoRA-wrapped LM (`lm` itself holds the layers; names are relative to it)."""

    def __init__(self, peft_model: PeftModel, lm: nn.Module) -> None:
        from peft.tuners.lora import LoraLayer  # noqa: PLC0415 -- see the TYPE_CHECKING import

        self.peft_model, self.lm = peft_model, lm
        cfg = peft_model.peft_config[ADAPTER]
        if cfg.peft_type.value != "LORA" or getattr(cfg, "use_dora", False):
            raise ValueError(f"only plain LoRA adapters are supported, got {cfg.peft_type.value} (use_dora="
                             f"{getattr(cfg, 'use_dora', False)})")
        self.layers = {name: m for name, m in lm.named_modules() if isinstance(m, LoraLayer)}
        refuse_tower_adapters(self.layers, cfg.target_modules, cfg.exclude_modules)  # a saved adapter's too
        fused = fused_expert_family(getattr(lm, "config", None))  # peft's ParamWrappers there: rlsp.models.lora_experts
        self.experts = expert_adapters(lm, ADAPTER) if fused else {}
        linear = {n: m for n, m in self.layers.items() if not (fused and type(m).__name__ == "ParamWrapper")}
        bad = sorted({n.rsplit(".", 1)[-1] for n in self.layers if n.rsplit(".", 1)[-1] in LORA_REFUSED_TARGETS})
        bad += sorted({type(m.base_layer).__name__ for m in linear.values() if type(m.base_layer) is not nn.Linear})
        if not self.layers or bad:
            raise ValueError(f"LoRA targets must be nn.Linear layers inside the decoder (not {list(LORA_REFUSED_TARGETS)}); "
                             f"got {len(self.layers)} adapted layers{', refused: ' + str(bad) if bad else ''} "
                             f"(target_modules={cfg.target_modules!r}, exclude_modules={cfg.exclude_modules!r})")
        self.scaling = {name: float(m.scaling[ADAPTER]) for name, m in linear.items()}
        self._expert_part = {n: (base, part) for base, e in self.experts.items()
                             for n, part in ((base, "W"), (e.lora_a, "A"), (e.lora_b, "B"))}
        for p in self.adapter_params():  # fp32 masters for what the optimizer updates
            p.data = p.data.float()

    def merged_lm(self) -> nn.Module:
        """`lm` with every adapter folded into its layer (peft's merge_and_unload), for an export."""
        self.peft_model.merge_and_unload()
        return self.lm

    @property
    def config(self) -> LoraConfig:
        return self.peft_model.peft_config[ADAPTER]

    def save_config(self, path: str, base_model: str) -> None:
        """Write adapter_config.json under `path`, naming `base_model` (what an export rebuilds on)."""
        cfg = copy.copy(self.config)
        cfg.base_model_name_or_path = base_model
        cfg.save_pretrained(path)

    def adapter_params(self) -> list[nn.Parameter]:
        return [p for n, p in self.lm.named_parameters() if is_adapter_param(n)]

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """Run the base model: every LoRA layer computes `base(x)` only (peft's disable_adapter())."""
        params = self.adapter_params()
        with self.peft_model.disable_adapter():
            # peft also marks the adapters frozen while they are off; FSDP2 reads requires_grad when it
            # initialises lazily (possibly in this forward) to set up gradient reduction, so keep it.
            for p in params:
                p.requires_grad_(True)
            yield

    def merge_for_rollout(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (any order within a layer) -> base names, each adapted weight replaced by
        `W + scale * B @ A` in fp32 (callers cast once, to the rollout dtype); holds one layer's parts at a time.
        A fused expert parameter is merged per expert under its fused name (rlsp.models.lora_experts.merge_expert)."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in named:
            if name in self._expert_part:  # a fused expert parameter or its adapter: merged under the fused name
                yield from self._merge_expert_part(pending, name, t)
                continue
            layer = next((name.split(tag)[0] for tag in (_BASE, _A, _B) if tag in name), None)
            if layer is None or layer not in self.scaling:
                yield name, t
                continue
            if _BASE in name and not name.endswith(".base_layer.weight"):
                yield base_name(name), t  # the base layer's bias passes through
                continue
            parts = pending.setdefault(layer, {})
            parts["W" if _BASE in name else "A" if _A in name else "B"] = t
            if len(parts) == 3:
                del pending[layer]
                w = parts["W"].float() + self.scaling[layer] * (parts["B"].float() @ parts["A"].float())
                yield f"{layer}.weight", w
        if pending:
            raise RuntimeError(f"LoRA layers missing parts when merging: {sorted(pending)[:3]}")

    def _merge_expert_part(self, pending: dict[str, dict[str, torch.Tensor]], name: str,
                           t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        base, part = self._expert_part[name]
        parts = pending.setdefault(base, {})
        parts[part] = t
        if len(parts) == 3:
            del pending[base]
            e = self.experts[base]
            yield e.param, merge_expert(e, parts["W"], parts["A"], parts["B"])
