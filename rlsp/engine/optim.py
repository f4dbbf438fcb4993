"""Optimizer and learning-rate schedule of a trainable engine: a torch.optim class by verl's name (AdamW by
default) over the trainable parameters, and its learning-rate schedule (rlsp.engine.lr_schedule: verl's constant
or cosine, with a linear warm-up).

verl's rule for the optimizer's arguments: lr and weight_decay always, betas for the Adam family (a name
containing "adam"), then `override_optimizer_config` on top (eps, momentum, amsgrad, ...; it wins). Names rlsp
cannot train with are refused with the reason (rlsp.config.choices.REFUSED_OPTIMIZERS).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rlsp.config.choices import OPTIMIZER_IMPLS, OPTIMIZERS, REFUSED_OPTIMIZERS
from rlsp.engine.lr_schedule import Schedule, compute_lr_factor


@dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    schedule: Schedule = field(default_factory=Schedule)  # the factor of lr per optimizer step, warm-up included
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    name: str = "AdamW"  # optim.optimizer: a torch.optim class (rlsp.config.choices.OPTIMIZERS)
    impl: str = "torch.optim"  # optim.optimizer_impl
    overrides: dict[str, Any] = field(default_factory=dict, hash=False)  # optim.override_optimizer_config


def optimizer_class(name: str, impl: str = "torch.optim") -> type[torch.optim.Optimizer]:
    """The torch.optim class called `name`; ValueError with the reason and the legal names otherwise."""
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optim.optimizer_impl={impl!r} is not supported; legal values: {list(OPTIMIZER_IMPLS)}")
    if name in REFUSED_OPTIMIZERS:
        raise ValueError(f"optim.optimizer={name!r} is not supported ({REFUSED_OPTIMIZERS[name]}); legal values: "
                         f"{list(OPTIMIZERS)}")
    if name not in OPTIMIZERS:
        near = [n for n in OPTIMIZERS if n.lower() == str(name).lower()]
        hint = f" (names are case-sensitive, as in verl: {near[0]!r})" if near else ""
        raise ValueError(f"optim.optimizer={name!r} is not supported{hint}; legal values: {list(OPTIMIZERS)}")
    return getattr(torch.optim, name)


def optimizer_kwargs(s: OptimSettings) -> dict[str, Any]:
    """The class's keyword arguments by verl's rule (module docstring); ValueError naming an override the class
    does not take, with the ones it does."""
    cls = optimizer_class(s.name, s.impl)
    kwargs: dict[str, Any] = {"lr": s.lr, "weight_decay": s.weight_decay}
    if "adam" in s.name.lower():
        kwargs["betas"] = tuple(s.betas)
    legal = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")]
    unknown = [k for k in s.overrides if k not in legal]
    if unknown:
        raise ValueError(f"optim.override_optimizer_config sets {unknown}, which torch.optim.{s.name} does not take; "
                         f"legal keys: {legal}")
    return {**kwargs, **s.overrides}


def build_optimizer(module: nn.Module, s: OptimSettings) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer over the parameters that require grad (all of them, or only LoRA adapters: frozen base
    weights get no optimizer state), and its learning-rate schedule."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(module).__name__} has no trainable parameters to optimise")
    optimizer = optimizer_class(s.name, s.impl)(params, **optimizer_kwargs(s))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: compute_lr_factor(s.schedule, step))
    return optimizer, scheduler
