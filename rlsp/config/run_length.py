"""How long a run is and how long its learning rate warms up, by verl's rules (no torch here).

Run length: `trainer.total_training_steps` when set explicitly, else `trainer.total_epochs` x the
batches of one epoch (full batches of `data.train_batch_size` prompts from the training set after
filtering; with dynamic sampling's `data.gen_batch_size`, batches of that many prompts, as verl's loader). The number of prompts is known only once the dataset is read, so the driver (and
`rlsp.check`) call `resolve_total_steps` right after reading it, before any worker has the run's config; from then
on the config carries the number.

Warm-up: `optim.lr_warmup_steps` training steps, or (when it is < 0) `optim.lr_warmup_steps_ratio`
of the run's training steps, as verl counts them. rlsp's scheduler steps once per optimizer step, so
the warm-up spans that many training steps' worth of optimizer steps (mini-batches x ppo_epochs); a cosine
schedule (`optim.lr_scheduler_type`) spans `optim.total_training_steps` (-1: the run's) the same way.
"""

from __future__ import annotations

from typing import Any

TRAINABLE_ROLES = ("actor", "critic")


def batches_per_epoch(num_prompts: int, train_batch_size: int) -> int:
    """Full batches in one pass over `num_prompts` (the remainder is dropped, as verl's loader does)."""
    return num_prompts // train_batch_size


def data_batch(cfg: Any) -> tuple[str, int]:
    """(key, prompts) of one data batch: data.gen_batch_size when set (dynamic sampling), else data.train_batch_size."""
    gen = cfg.data.get("gen_batch_size")
    return ("data.train_batch_size", int(cfg.data.train_batch_size)) if gen is None else ("data.gen_batch_size", int(gen))


def planned_steps(cfg: Any, num_prompts: int) -> tuple[int, int]:
    """(the run's training steps, the steps the epochs hold) for a training set of `num_prompts`."""
    t = cfg.trainer
    available = batches_per_epoch(num_prompts, data_batch(cfg)[1]) * t.total_epochs
    return (available if t.total_training_steps is None else int(t.total_training_steps)), available


def run_length_errors(cfg: Any, num_prompts: int) -> list[str]:
    """Why the run length cannot be met with `num_prompts` training prompts (empty when it can)."""
    t, (key, batch) = cfg.trainer, data_batch(cfg)
    per_epoch = batches_per_epoch(num_prompts, batch)
    steps, available = planned_steps(cfg, num_prompts)
    if per_epoch < 1:
        return [f"{key}={batch} exceeds the {num_prompts} training prompts: not one full batch"]
    if t.total_training_steps is not None and steps > available:
        return [f"trainer.total_training_steps={steps} exceeds trainer.total_epochs={t.total_epochs} x {per_epoch} "
                f"batches per epoch = {available} steps; raise trainer.total_epochs or lower total_training_steps"]
    return []


def resolve_total_steps(cfg: Any, num_prompts: int) -> int:
    """Write the run's training steps into `cfg.trainer.total_training_steps` (see the module docstring)."""
    errors = run_length_errors(cfg, num_prompts)
    if errors:
        raise ValueError(errors[0])
    cfg.trainer.total_training_steps = planned_steps(cfg, num_prompts)[0]
    return int(cfg.trainer.total_training_steps)


def warmup_errors(prefix: str, optim: Any) -> list[str]:
    """The warm-up keys of one optimizer: a ratio in [0, 1], never two warm-ups at once."""
    steps, ratio = optim.lr_warmup_steps, optim.lr_warmup_steps_ratio
    if not 0.0 <= ratio <= 1.0:
        return [f"{prefix}lr_warmup_steps_ratio={ratio} must be in [0, 1]"]
    if steps >= 0 and ratio > 0.0:
        return [f"{prefix}lr_warmup_steps={steps} and {prefix}lr_warmup_steps_ratio={ratio} both set a warm-up (a "
                f"warm-up of >= 0 steps wins over the ratio); set lr_warmup_steps=-1 to use the ratio, or ratio 0"]
    return []


SCHEDULE_TYPES = ("constant", "cosine")


def schedule_type(optim: Any) -> str:
    """optim.lr_scheduler_type, or verl's deprecated warmup_style when that is set instead."""
    return str(optim.lr_scheduler_type if optim.warmup_style is None else optim.warmup_style)


def schedule_errors(prefix: str, optim: Any) -> list[str]:
    """The schedule keys of one optimizer: a known type (warmup_style not contradicting it), cosine's settings
    in range, and none of them set where the constant schedule would not read them."""
    errors, kind = [], schedule_type(optim)
    style = optim.warmup_style
    if style is not None and optim.lr_scheduler_type not in ("constant", style):
        errors.append(f"{prefix}warmup_style={style!r} (verl's old spelling of lr_scheduler_type) contradicts "
                      f"{prefix}lr_scheduler_type={optim.lr_scheduler_type!r}; set only lr_scheduler_type")
    if kind not in SCHEDULE_TYPES:
        key = "lr_scheduler_type" if style is None else "warmup_style"
        return errors + [f"{prefix}{key}={kind!r} is not supported; legal values: {list(SCHEDULE_TYPES)}"]
    if not 0.0 <= optim.min_lr_ratio <= 1.0:
        errors.append(f"{prefix}min_lr_ratio={optim.min_lr_ratio} must be in [0, 1]")
    if not optim.num_cycles > 0:
        errors.append(f"{prefix}num_cycles={optim.num_cycles} must be > 0")
    steps = optim.total_training_steps
    if not isinstance(steps, int) or (steps != -1 and steps < 1):
        errors.append(f"{prefix}total_training_steps={steps} must be -1 (the run's) or an integer >= 1")
    if kind == "constant":
        unread = [f"{k}={optim[k]}" for k, off in (("min_lr_ratio", 0.0), ("num_cycles", 0.5),
                                                    ("zero_indexed_step", True), ("total_training_steps", -1))
                  if optim[k] != off]
        if unread:
            errors.append(f"{prefix}{', '.join(unread)} only shape the cosine schedule and would have no effect with "
                          f"lr_scheduler_type=constant; set {prefix}lr_scheduler_type=cosine or leave them unset")
    return errors


def schedule_optimizer_steps(cfg: Any, role: str) -> int:
    """The optimizer steps a cosine schedule of `role` spans: optim.total_training_steps (-1: the run's) training
    steps' worth."""
    node = cfg.actor_rollout_ref.actor if role == "actor" else cfg.critic
    steps = node.optim.total_training_steps
    steps = cfg.trainer.total_training_steps if steps == -1 else steps
    return int(steps or 0) * optimizer_steps_per_update(cfg, role)


def warmup_training_steps(optim: Any, total_steps: int | None) -> int:
    """Training steps of the linear warm-up (verl's rule: lr_warmup_steps, else ratio x total steps)."""
    if optim.lr_warmup_steps >= 0:
        return int(optim.lr_warmup_steps)
    if optim.lr_warmup_steps_ratio == 0.0:
        return 0
    if total_steps is None:
        raise ValueError("lr_warmup_steps_ratio needs the run length: trainer.total_training_steps is resolved from "
                         "the dataset by the driver before workers have the run's config")
    return int(optim.lr_warmup_steps_ratio * total_steps)


def optimizer_steps_per_update(cfg: Any, role: str) -> int:
    """Optimizer steps of one training step's update: mini-batches per batch x ppo_epochs."""
    node = cfg.actor_rollout_ref.actor if role == "actor" else cfg.critic
    return max(1, cfg.data.train_batch_size // node.ppo_mini_batch_size) * node.ppo_epochs


def warmup_optimizer_steps(cfg: Any, role: str) -> int:
    """The warm-up of `role` ("actor" or "critic") in the optimizer steps rlsp's scheduler counts."""
    if role not in TRAINABLE_ROLES:
        raise ValueError(f"unknown trainable role {role!r}; legal roles: {list(TRAINABLE_ROLES)}")
    node = cfg.actor_rollout_ref.actor if role == "actor" else cfg.critic
    train_steps = warmup_training_steps(node.optim, cfg.trainer.total_training_steps)
    return train_steps * optimizer_steps_per_update(cfg, role)
