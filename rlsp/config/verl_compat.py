"""verl command lines in rlsp: the keys spelled differently, refused by name, or accepted with a note.

A verl key is in one of four states here (no key is silently ignored):

* declared in the schema with verl's meaning (most keys: same name, same behaviour);
* `ALIASES`: verl's spelling of an rlsp key; `apply_verl_spellings` moves the value onto rlsp's key
  when the config is composed (validate_config runs it first), and refuses the pair when both are
  set to different values, so one key is the only source of truth;
* `UNSUPPORTED_KEYS`: not declared, refused by name with the reason (features rlsp does not have);
  `NOT_YET_KEYS` likewise for features in progress, until the schema declares them;
* `VERL_NOTES`: declared and accepted, but rlsp reaches verl's result another way; the note says how
  (`rlsp.check` prints it for every such key a command sets, docs/config.md lists them all).
"""

from __future__ import annotations

import fnmatch
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlsp.config.verl_0_9_tables import UNSUPPORTED_0_9
from rlsp.config.verl_notes import VERL_NOTES
from rlsp.config.verl_spellings import REWARD_LOOP_KEY, rlsp_key

# verl's spelling -> the rlsp key that carries the setting.
ALIASES = {
    "custom_reward_function.path": "reward.custom_function_path",
    "custom_reward_function.name": "reward.custom_function_name",
    "actor_rollout_ref.actor.optim.clip_grad": "actor_rollout_ref.actor.optim.grad_clip",
    "critic.optim.clip_grad": "critic.optim.grad_clip",
    # DAPO's reward keys as verl spelled them before moving them under reward.*
    "reward_model.reward_manager": "reward.reward_manager.name",
    **{f"reward_model.overlong_buffer.{k}": f"reward.reward_kwargs.overlong_buffer_cfg.{k}"
       for k in ("enable", "len", "penalty_factor", "log")},
}

_PROFILER = ("profiler back-ends (nsys, torch profiler, NPU) are not implemented in rlsp; every step logs where its "
             "time went (timing/* metrics, per-role update phases)")
_RM_POOL = ("a reward-model pool of its own is not supported: the reward model runs on the policy workers "
            "(reward_model.ulysses_sequence_parallel_size and model.fsdp_config shard it there)")
# Schema mappings whose entries the user names (any key under them is declared): verl's engine arguments and
# the workers' environment variables.
OPEN_MAPPINGS = ("actor_rollout_ref.rollout.engine_kwargs.vllm", "actor_rollout_ref.rollout.engine_kwargs.sglang",
                 "actor_rollout_ref.rollout.engine_kwargs.trtllm", "ray_kwargs.ray_init.runtime_env.env_vars")
# Keys (fnmatch patterns) rlsp refuses by name: verl features it does not implement.
UNSUPPORTED_KEYS = {
    "algorithm.use_pf_ppo": "pf-PPO (re-weighting or re-sampling rows by their reward) is not implemented in rlsp",
    "algorithm.pf_ppo.*": "pf-PPO (re-weighting or re-sampling rows by their reward) is not implemented in rlsp",
    "global_profiler.*": _PROFILER,
    "*.profiler.*": _PROFILER,
    "npu_profile.*": "Ascend NPUs are not supported (rlsp runs on CUDA GPUs or CPUs)",
    "reward_model.sandbox_fusion.*": "rewards from a remote code sandbox (Sandbox Fusion) are not implemented in rlsp; "
                                     "score code locally with reward.custom_function_path",
    "reward_model.enable_resource_pool": _RM_POOL,
    "reward_model.nnodes": _RM_POOL,
    "reward_model.n_gpus_per_node": _RM_POOL,
    "reward_model.micro_batch_size": "verl's deprecated global micro-batch size is not supported; set "
                                     "reward_model.micro_batch_size_per_gpu",
    "reward_model.max_length": "truncating the reward model's input is not supported: rlsp scores whole sequences and "
                               "refuses one longer than the reward model's max_position_embeddings",
    "*.model.override_config.*": "overriding entries of the model's config.json is not supported (except the "
                                 "actor's output_router_logits and router_aux_loss_coef): rlsp builds the model as its "
                                 "config.json says (edit a copy of the checkpoint's config.json, e.g. "
                                 "max_position_embeddings)",
    "ray_kwargs.ray_init.runtime_env.*": "of Ray's runtime_env rlsp passes env_vars and py_executable (to the run's "
                                         "job); for working_dir, pip, conda or containers start Ray yourself and join "
                                         "it with trainer.ray_address",
    "ray_kwargs.ray_init.*": "rlsp starts its private Ray with num_cpus, object_store_memory and runtime_env (env_vars, "
                             "py_executable) only; for other ray.init arguments start Ray yourself and join it with "
                             "trainer.ray_address",
    **UNSUPPORTED_0_9,  # the rest of verl 0.9's key surface (rlsp.config.verl_keys)
}
# Keys of features being implemented now: refused by name until the schema declares them.
NOT_YET_KEYS: dict[str, str] = {}  # none in progress now
# Values of those features, likewise: (key, value) -> the feature; an unknown-value error names them until then.
NOT_YET_VALUES: dict[tuple[str, str], str] = {}  # none in progress now



def _match(key: str, table: dict[str, str]) -> str | None:
    """The text of the first pattern matching `key`, or matching everything under section `key`."""
    for pattern, text in table.items():
        if fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(f"{key}.*", pattern):
            return text
    return None


def unsupported_reason(key: str) -> str | None:
    """Why rlsp refuses the undeclared key `key`, or None when it is not a known verl key."""
    if any(key.startswith(f"{mapping}.") for mapping in OPEN_MAPPINGS):
        return None  # an entry of a mapping the schema declares
    reason = _match(key, UNSUPPORTED_KEYS)
    if reason is not None:
        return reason
    feature = _pending_feature(key)
    return None if feature is None else f"{feature}: not implemented in rlsp yet"


def _pending_feature(key: str) -> str | None:
    """The NOT_YET_KEYS feature of `key`, unless the schema declares that feature's section by now (then an
    undeclared key under it is a plain unknown key, e.g. a misspelt one, named with the nearest legal keys)."""
    for pattern, text in NOT_YET_KEYS.items():
        if fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(f"{key}.*", pattern):
            from rlsp.config.validate_keys import schema_keys  # noqa: PLC0415  (validate_keys imports this module)

            return None if pattern.removesuffix(".*") in schema_keys() else text
    return None


def in_progress(key: str) -> bool:
    """Whether undeclared `key` belongs to a feature being implemented (NOT_YET_KEYS)."""
    return _match(key, UNSUPPORTED_KEYS) is None and _pending_feature(key) is not None


def refusal(key: str) -> str | None:
    """The error for setting the undeclared verl key `key`, or None when it is no known verl key."""
    reason = unsupported_reason(key)
    return None if reason is None else f"{key} is not supported: {reason}"


def verl_note(key: str) -> str | None:
    """What rlsp does with the declared verl key `key` (or verl's other spelling of one: rlsp.config.verl_spellings),
    when that differs from a plain same-name setting."""
    target = rlsp_key(key)
    if target == key:
        return _match(key, VERL_NOTES)
    note = f"verl's other spelling of {target} (rewritten onto it)"
    if key.startswith("reward.reward_model."):
        note += f"; sets {REWARD_LOOP_KEY}=true unless given (newer verl serves reward models by its reward loop only)"
    more = _match(target, VERL_NOTES)
    return f"{note}; {more}" if more else note


def verl_key_notes(overrides: list[str]) -> list[str]:
    """`key: note` for every override whose verl key rlsp handles its own way (what rlsp.main logs at start-up)."""
    keys = dict.fromkeys(text.lstrip("+~").partition("=")[0] for text in overrides if not text.startswith("-"))
    return [f"{key}: {note}" for key in keys if (note := verl_note(key))]


def verl_status(key: str, declared: set[str]) -> str:
    """What rlsp does with verl key `key` (`declared`: the schema's keys), for docs/config.md."""
    if key in ALIASES:
        return f"verl's spelling of `{ALIASES[key]}` (mapped onto it)"
    if rlsp_key(key) != key:
        return f"verl's other spelling of `{rlsp_key(key)}` (rewritten onto it)"
    if key not in declared and not any(key.startswith(f"{mapping}.") for mapping in OPEN_MAPPINGS):
        reason = unsupported_reason(key)
        return f"refused: {reason}" if reason else "unknown to rlsp (refused as an unknown key)"
    note = verl_note(key)
    return f"accepted: {note}" if note else "same key, same meaning"


def apply_verl_spellings(cfg: Any, errors: list[str]) -> None:
    """Map verl's spellings onto rlsp's keys in place (see the module docstring); a string logger
    becomes a one-name list. Idempotent: mapped aliases are left unset."""
    if not isinstance(cfg, DictConfig):
        return
    from rlsp.config.schema import RLSPConfig  # noqa: PLC0415  (the schema imports nothing from here)

    defaults = OmegaConf.structured(RLSPConfig)
    for alias, key in ALIASES.items():
        value = OmegaConf.select(cfg, alias, default=None)
        if value is None:
            continue
        current = OmegaConf.select(cfg, key)
        if current not in (OmegaConf.select(defaults, key), value):
            errors.append(f"{alias}={value!r} (verl's spelling) and {key}={current!r} are the same setting with "
                          "different values; set only one of them")
            continue
        OmegaConf.update(cfg, key, value)
        OmegaConf.update(cfg, alias, None)
    logger = cfg.trainer.logger
    if isinstance(logger, str):
        cfg.trainer.logger = [logger]
