"""Start-up checks of the keys rlsp takes from verl in verl's meaning (see rlsp.config.verl_compat).

Values only (no torch, no files); `validate_config` calls `check_verl_keys` and collects every
message into its one error. Values rlsp does not implement are refused naming the key, the reason
and the legal values.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.choices import (
    FUSED_KERNEL_BACKENDS,
    LEGACY_WORKER_IMPL,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    REFUSED_OPTIMIZERS,
    ROLLOUT_MODES,
    STRATEGIES,
    TRUNCATIONS,
    choice_error,
)
from rlsp.config.run_length import schedule_errors, warmup_errors
from rlsp.config.validate_verl_runtime import check_verl_runtime_keys


def _check_padding(cfg: Any, errors: list[str]) -> None:
    """use_remove_padding=false: verl's padded forward of the same model, which rlsp does not need (it always
    packs; a start-up note says the flag has no effect). verl refuses it with Ulysses, and so does rlsp."""
    arr = cfg.actor_rollout_ref
    ref_sp = arr.ref.ulysses_sequence_parallel_size
    for prefix, unpadded, degrees in (
        ("actor_rollout_ref", arr.model.use_remove_padding,
         (("actor_rollout_ref.actor", arr.actor.ulysses_sequence_parallel_size), ("actor_rollout_ref.ref", ref_sp))),
        ("critic", cfg.critic.model.use_remove_padding, (("critic", cfg.critic.ulysses_sequence_parallel_size),)),
    ):
        for role, sp in degrees:
            if not unpadded and sp is not None and sp > 1:
                errors.append(f"{prefix}.model.use_remove_padding=false with {role}.ulysses_sequence_parallel_size="
                              f"{sp} is not supported: verl requires use_remove_padding=true for Ulysses sequence "
                              "parallelism (it shards the unpadded stream); set use_remove_padding=true (rlsp packs "
                              "sequences either way)")


def _check_choices(cfg: Any, errors: list[str]) -> None:
    arr = cfg.actor_rollout_ref
    for key, value, legal in (
        ("data.truncation", cfg.data.truncation, TRUNCATIONS),
        ("actor_rollout_ref.actor.strategy", arr.actor.strategy, STRATEGIES),
        ("actor_rollout_ref.ref.strategy", arr.ref.strategy, STRATEGIES),
        ("critic.strategy", cfg.critic.strategy, STRATEGIES),
        ("actor_rollout_ref.rollout.mode", arr.rollout.mode, ROLLOUT_MODES),
        ("actor_rollout_ref.model.fused_kernel_options.impl_backend", arr.model.fused_kernel_options.impl_backend,
         FUSED_KERNEL_BACKENDS),
        ("trainer.use_legacy_worker_impl", cfg.trainer.use_legacy_worker_impl, LEGACY_WORKER_IMPL),
    ):
        error = choice_error(key, value, legal)
        if error:
            errors.append(error)


def _check_fixed(cfg: Any, errors: list[str]) -> None:
    """Keys with one legal value in rlsp: the other is refused with the reason."""
    arr = cfg.actor_rollout_ref
    _check_padding(cfg, errors)
    if not arr.rollout.free_cache_engine:
        errors.append("actor_rollout_ref.rollout.free_cache_engine=false is not supported: rlsp always frees the rollout "
                      "engine's KV cache and weights while the colocated trainer runs; legal values: [true]")
    if arr.model.use_shm and cfg.trainer.nnodes > 1:
        errors.append(f"actor_rollout_ref.model.use_shm=true with trainer.nnodes={cfg.trainer.nnodes}: rlsp copies the "
                      "model into the driver node's /dev/shm, which other nodes cannot read; legal: use_shm=false, or "
                      "trainer.nnodes=1")


def _check_val_kwargs(cfg: Any, errors: list[str]) -> None:
    v, key = cfg.actor_rollout_ref.rollout.val_kwargs, "actor_rollout_ref.rollout.val_kwargs"
    if not isinstance(v.n, int) or v.n < 1:
        errors.append(f"{key}.n={v.n} must be an integer >= 1")
    if v.temperature < 0.0:
        errors.append(f"{key}.temperature={v.temperature} must be >= 0 (0 = greedy)")
    if not 0.0 < v.top_p <= 1.0:
        errors.append(f"{key}.top_p={v.top_p} must be in (0, 1]")
    if v.top_k == 0 or v.top_k < -1:
        errors.append(f"{key}.top_k={v.top_k} must be -1 (off) or >= 1")
    if not v.do_sample:
        unread = [f"{k}={v[k]}" for k, off in (("temperature", 0.0), ("top_p", 1.0), ("top_k", -1)) if v[k] != off]
        if unread:
            errors.append(f"{key}.do_sample=false validates greedily, so {key}.{', .'.join(unread)} would have no effect; "
                          f"set {key}.do_sample=true to sample, or leave them at their defaults")


# apply_chat_template arguments rlsp sets itself at every render (the messages, tools, generation prompt, output form).
RENDER_ARGS = ("conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
               "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length")


def _check_chat_template_kwargs(cfg: Any, errors: list[str]) -> None:
    """data.apply_chat_template_kwargs: template variables (enable_thinking, ...), not the arguments rlsp sets."""
    kwargs, key = cfg.data.apply_chat_template_kwargs, "data.apply_chat_template_kwargs"
    if kwargs is None:
        return
    if not hasattr(kwargs, "keys"):
        errors.append(f"{key}={kwargs!r} must be a mapping of keyword arguments (e.g. {{enable_thinking: false}})")
        return
    taken = [k for k in kwargs.keys() if k in RENDER_ARGS]
    if taken:
        errors.append(f"{key} sets {taken}, which rlsp sets itself at every chat-template render; legal: template "
                      f"variables other than {list(RENDER_ARGS)} (e.g. enable_thinking)")


def _check_optim(prefix: str, optim: Any, errors: list[str]) -> None:
    """optim.optimizer / optimizer_impl / override_optimizer_config of one trainable role (the override's keys
    are checked against the class's arguments where the engine builds it: rlsp.engine.optim)."""
    name = optim.optimizer
    if name not in OPTIMIZERS:
        why = f" ({REFUSED_OPTIMIZERS[name]})" if name in REFUSED_OPTIMIZERS else ""
        near = [n for n in OPTIMIZERS if n.lower() == str(name).lower()]
        why += f" (names are case-sensitive, as in verl: {near[0]!r})" if near else ""
        errors.append(f"{prefix}optimizer={name!r} is not supported{why}; legal values: {list(OPTIMIZERS)}")
    if (error := choice_error(f"{prefix}optimizer_impl", optim.optimizer_impl, OPTIMIZER_IMPLS)) is not None:
        errors.append(error)
    extra = optim.override_optimizer_config
    if extra is not None and not hasattr(extra, "keys"):
        errors.append(f"{prefix}override_optimizer_config={extra!r} must be a mapping of the optimizer's keyword "
                      "arguments (e.g. {eps: 1e-6}) or null")
    elif extra is not None and "params" in extra:
        errors.append(f"{prefix}override_optimizer_config sets 'params': the trainable parameters are rlsp's to give")


def _check_run(cfg: Any, errors: list[str]) -> None:
    t = cfg.trainer
    if not isinstance(t.total_epochs, int) or t.total_epochs < 1:
        errors.append(f"trainer.total_epochs={t.total_epochs} must be an integer >= 1")
    steps = t.total_training_steps
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        errors.append(f"trainer.total_training_steps={steps} must be an integer >= 1, or null (total_epochs x batches "
                      "per epoch)")
    for prefix, optim in (("actor_rollout_ref.actor.optim.", cfg.actor_rollout_ref.actor.optim),
                          ("critic.optim.", cfg.critic.optim)):
        errors += warmup_errors(prefix, optim) + schedule_errors(prefix, optim)
    _check_optim("actor_rollout_ref.actor.optim.", cfg.actor_rollout_ref.actor.optim, errors)
    for role, legal in (("actor", (True, False, "auto")), ("ref", (True, False, "auto", None))):
        value = cfg.actor_rollout_ref[role].use_torch_compile
        if value not in legal or isinstance(value, int) and not isinstance(value, bool):
            errors.append(f"actor_rollout_ref.{role}.use_torch_compile={value!r} is not supported; legal values: "
                          f"{list(legal)}")
    _check_optim("critic.optim.", cfg.critic.optim, errors)
    logger = t.logger
    if not isinstance(logger, str) and not all(isinstance(name, str) for name in logger):
        errors.append(f"trainer.logger={logger!r} must be a logger name or a list of names")


def check_verl_keys(cfg: Any, errors: list[str]) -> None:
    """Every verl-meaning key: legal values, one-value keys, validation sampling, run length, warm-up, and the
    engine and runtime keys (rlsp.config.validate_verl_runtime)."""
    _check_choices(cfg, errors)
    _check_fixed(cfg, errors)
    _check_val_kwargs(cfg, errors)
    _check_run(cfg, errors)
    _check_chat_template_kwargs(cfg, errors)
    check_verl_runtime_keys(cfg, errors)
