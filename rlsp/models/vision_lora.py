"""LoRA, tiled MLP and lean RMSNorm on a vision-language model's language model only.

A vision-language model loaded with its tower (rlsp.models.vision_inputs.TOWER_FAMILIES: Qwen2.5-VL, Qwen3-VL,
Qwen3-VL-MoE, a Qwen3.5 wrapper with images) holds the vision tower and its mergers under `model.visual`, beside the
language model `model.language_model`. rlsp's LoRA and memory features act on the language model only:
- `language_model(lm)`: the decoder `apply_tiled_mlp` / `apply_lean_rmsnorm` transform (`lm.model` of a text LM);
- `tower_excluded(lm, exclude)`: peft's `exclude_modules` with the tower added. A string is a regex peft matches
  against whole module names (`re.fullmatch`); a list names modules by suffix (a name, or a name after a dot). Both
  become one regex with the tower's `model\\.visual(\\..*)?` in front, so `all-linear` and named targets never wrap
  a tower or merger layer; the adapter config saved with a checkpoint keeps the regex, and an export rebuilds the
  same layers from it;
- `refuse_tower_adapters(names, ...)`: an adapter continued from a directory (`lora_adapter_path`) whose config
  adapts tower layers is refused (dropping them would lose trained weights);
- `lora_target_errors(path, model)`: rlsp.check's view of the same, on a weightless (meta-device) model: a named
  target found in the tower only (e.g. Qwen-VL's `qkv`), or nowhere, is refused by name, listing the language
  model's linear layers; a saved adapter that adapts tower layers likewise (peft's own injection decides).
The tower's weights stay frozen under LoRA (every base weight is), whatever `actor.freeze_vision_tower` says.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rlsp.config.lora_keys import LORA_REFUSED_TARGETS
from rlsp.utils.logging import get_logger, log_once

TOWER_PREFIX = "model.visual"  # the vision tower and its mergers, in every family of TOWER_FAMILIES
TOWER_REGEX = r"model\.visual(?:\..*)?"


def has_tower(lm: nn.Module) -> bool:
    """Whether `lm` holds a vision tower (`lm.model.visual`)."""
    return isinstance(getattr(getattr(lm, "model", None), "visual", None), nn.Module)


def language_model(lm: nn.Module) -> nn.Module:
    """The decoder (HF base model with `layers`) of a causal LM or of a vision-language model's language model."""
    return lm.model.language_model if has_tower(lm) else lm.model


def in_tower(name: str) -> bool:
    return name == TOWER_PREFIX or name.startswith(TOWER_PREFIX + ".")


def tower_excluded(lm: nn.Module, exclude: str | tuple[str, ...] | list[str] | None) -> str | tuple[str, ...] | None:
    """`exclude` (peft's exclude_modules) with `lm`'s vision tower added as one regex; unchanged for a text LM."""
    if not has_tower(lm):
        return exclude
    parts = [TOWER_REGEX]
    if isinstance(exclude, str):
        parts.append(exclude)
    elif exclude:  # peft's list rule: the whole name, or a suffix after a dot
        parts += [rf"(?:.*\.)?{re.escape(name)}" for name in exclude]
    return "|".join(f"(?:{p})" for p in parts)


def refuse_tower_adapters(names: Iterable[str], target_modules: Any, exclude_modules: Any) -> None:
    """Raise when any adapted layer (`names`, relative to the causal LM) lies in the vision tower."""
    tower = sorted(n for n in names if in_tower(n))
    if tower:
        raise ValueError(f"the LoRA adapter adapts {len(tower)} vision-tower layers ({tower[:3]}, target_modules="
                         f"{target_modules!r}, exclude_modules={exclude_modules!r}); rlsp adapts a vision-language "
                         f"model's language model only: legal: an adapter whose layers lie outside {TOWER_PREFIX}.*")


def note_frozen_tower(lm: nn.Module, freeze_vision_tower: bool) -> None:
    """Say once at start-up that LoRA keeps the tower frozen when `actor.freeze_vision_tower=false` (verl's default)
    asks to train it: LoRA trains the language model's adapters only."""
    if has_tower(lm) and not freeze_vision_tower:
        log_once(get_logger("rlsp.models.lora"), "lora:tower", "LoRA: the vision tower stays frozen (LoRA trains the "
                 "language model's adapters only); actor_rollout_ref.actor.freeze_vision_tower=false has no effect")


def _meta_model(path: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForImageTextToText  # noqa: PLC0415 -- rlsp.check only

    with torch.device("meta"):  # the module tree only: no weight is allocated
        return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))


def _suffix_match(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def lora_target_errors(path: str, model: Any, key: str = "actor_rollout_ref.model") -> list[str]:
    """What rlsp.check refuses about the LoRA targets of `model` (the `*.model` section) on the vision-language model
    at `path`, loaded with its tower."""
    if model.lora_adapter_path:
        return _adapter_errors(_meta_model(path), str(model.lora_adapter_path), key)
    targets = model.target_modules
    if isinstance(targets, str):  # all-linear (validate_lora refuses other strings): the tower is excluded
        return []
    lm = _meta_model(path)
    linears = [n for n, m in lm.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    text = [n for n in linears if not in_tower(n)]
    legal = sorted({n.rsplit(".", 1)[-1] for n in text})
    errors = []
    for target in targets:
        if target in LORA_REFUSED_TARGETS or any(_suffix_match(n, target) for n in text):  # validate_lora names those
            continue
        tower = [n for n in linears if _suffix_match(n, target)]
        where = (f"a layer of the vision tower only ({tower[0]}, ...)" if tower
                 else "no linear layer of the language model")
        errors.append(f"{key}.target_modules names {target!r}: {where}; rlsp adapts a vision-language model's language "
                      f"model only (the tower stays frozen); legal names: {legal} (or 'all-linear')")
    return errors


def _adapter_errors(lm: nn.Module, adapter_path: str, key: str) -> list[str]:
    from peft import LoraConfig, inject_adapter_in_model  # noqa: PLC0415 -- rlsp.check with LoRA only
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415

    try:
        config = LoraConfig.from_pretrained(adapter_path)
    except (OSError, ValueError):  # no adapter there: the start-up checks of the LoRA keys name it
        return []
    try:
        inject_adapter_in_model(config, lm, low_cpu_mem_usage=True)
        refuse_tower_adapters((n for n, m in lm.named_modules() if isinstance(m, LoraLayer)), config.target_modules,
                              config.exclude_modules)
    except ValueError as exc:
        return [f"{key}.lora_adapter_path={adapter_path!r}: {exc}"]
    return []
