"""`auto` settings: the values a user did not choose, decided from the model and the machine.

A key whose value is `auto` (its default) is resolved here, first in the config stage (before the
layout is built), into the value the run then uses; an explicit value is never changed. Each
decision is returned as an `AutoChoice` with its reason: `python -m rlsp.main` prints them once at
start-up and `python -m rlsp.check` in its report.

    fsdp_config.fsdp_size (actor, ref, critic.model, reward_model.model)
        actor / critic: 1 (every rank holds the whole model, only gradients are reduced: the least
        communication) when its training state -- fp32 weights, gradients and AdamW's two moments,
        16 bytes a parameter (4 with LoRA: the frozen base only), plus the reference's 4 bytes a
        parameter -- takes at most 1/REPLICATE_SHARE of one rank's memory (on cuda the part vLLM's
        `gpu_memory_utilization` leaves); else -1 (FSDP over all ranks), also when FSDP offload is
        asked for or the model or the memory is unknown here (verl's default). The reference follows
        the actor (with LoRA it must: it is the actor's own model); the legacy reward model keeps -1.
    rollout.name
        hf (transformers' model and KV cache, rlsp's decoding loop) on cpu for models of at most HF_ROLLOUT_MAX_PARAMS parameters,
        where vLLM's fixed cost per decoding step is larger than the model's own, and for head sizes
        vLLM's CPU attention has no kernel for; vllm otherwise and
        whenever a vLLM-only setting is used (ignore_eos, rollout tp > 1, load_format, engine_kwargs.vllm,
        the reward loop).
    model.enable_gradient_checkpointing (actor_rollout_ref.model: actor and reference; critic.model)
        on when the activations one training micro-batch saves without it exceed half of what the
        training state leaves of the rank's memory (rlsp.config.auto_memory; a vision-language actor adds its
        tower's activations for the data's image tokens, rlsp.config.auto_vision), or activation offload is
        asked for; off otherwise, and when the model or the memory is unknown (verl's default).
    actor.use_dynamic_bsz (the critic, the reference and the old-logprob pass follow it)
        true -- micro-batches filled to `ppo_max_token_len_per_gpu` tokens: fewer, fuller passes, the
        same result -- unless `ppo_micro_batch_size_per_gpu` was set (then false: fixed rows, as verl).
    fsdp_config.expert_parallel_size (actor, ref, critic.model; rlsp.config.auto_memory.ep_value)
        1 for a dense model, or when the rank's training state plus FSDP's gathered experts take at most half of
        its memory; else the smallest degree dividing both the role's ranks and the experts that fits (the
        reference follows the actor).
    reward_model.num_workers (rule scoring processes)
        0 -- the policy workers score the rows they generated, between generation and update, when
        they would wait for the scores anyway: no process of its own, which would import torch and
        transformers beside them at start-up -- unless a rollout pool generates while the trainer
        trains (then 1: scoring must not queue behind an update).

The memory rules (fsdp_size, checkpointing) are rlsp.config.auto_roles'. No torch here (rlsp.config.machine reads
the machine without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlsp.config.auto_memory import EP_ROLES, ep_choices
from rlsp.config.auto_roles import (
    LORA_STATE_BYTES,
    REFERENCE_BYTES,
    REPLICATE_SHARE,
    STATE_BYTES,
    checkpointing_value,
    fsdp_value,
    train_memory,
)
from rlsp.config.choices import VLLM_CPU_HEAD_DIMS
from rlsp.config.layout import CRITIC_ESTIMATORS
from rlsp.config.layout_build import has_reference
from rlsp.config.machine import Machine, machine_facts
from rlsp.config.model_shape import ModelShape, read_model_shape, shape_of_config
from rlsp.config.run_spec import rollout_pool_enabled
from rlsp.config.schema import ActorConfig

AUTO = "auto"
# The memory rules' constants live in rlsp.config.auto_roles; importable from here.
__all__ = ["AUTO", "AUTO_KEYS", "BUILTIN_SHAPES", "HF_ROLLOUT_MAX_PARAMS", "LORA_STATE_BYTES", "REFERENCE_BYTES",
           "REPLICATE_SHARE", "STATE_BYTES", "AutoChoice", "model_shape", "resolve_auto"]
# On these 2-core CPUs: 0.3M parameters (2 layers, hidden 128) generate 64 x 32 tokens in 0.13 s with HF
# against 0.29 s with vLLM; at 22.5M (8 layers, hidden 512, 256 tokens) both take ~19 s (docs/benchmarks.md).
HF_ROLLOUT_MAX_PARAMS = 10_000_000
# The built-in tiny Qwen2.5-VL's config.json as far as its shape goes (rlsp.models.tiny_vl's TinyVLSpec() over its
# 78-token vocabulary: 64 tokens + one per colour word; rlsp.config may not import rlsp.models, so
# tests/unit/test_builtin_vl_shape.py compares these numbers with the spec and the built model's config.json).
TINY_VL_CONFIG = {
    "model_type": "qwen2_5_vl", "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen2_5_vl_text", "num_hidden_layers": 2, "hidden_size": 128,
                    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 78,
                    "max_position_embeddings": 512, "layer_types": ["full_attention"] * 2,
                    "use_sliding_window": False, "sliding_window": None},
    "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "in_channels": 3,
                      "out_hidden_size": 128, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2},
}
# The models rlsp builds itself (rlsp.models.tiny's default spec with the 58-token char tokenizer;
# tests/unit/test_auto_settings.py reads the built model's config.json against this), and its tiny vision-language
# model with its tower (what the memory rules count for the tower: rlsp.config.auto_vision).
BUILTIN_SHAPES = {"builtin://tiny-qwen2": ModelShape(layers=2, hidden=128, q_heads=4, kv_heads=2, head_dim=32,
                                                     intermediate=256, vocab=58, tied=True, qkv_bias=True,
                                                     name="tiny-qwen2", max_positions=256),
                  "builtin://tiny-qwen2.5-vl": shape_of_config(TINY_VL_CONFIG, "tiny-qwen2.5-vl")}
DYNAMIC_BSZ_KEYS = ("actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
                    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "critic.use_dynamic_bsz")
FSDP_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model", "reward_model.model")
CHECKPOINTING_KEYS = ("actor_rollout_ref.model.enable_gradient_checkpointing", "critic.model.enable_gradient_checkpointing")
SCORING_KEY = "reward_model.num_workers"
AUTO_KEYS = ("actor_rollout_ref.rollout.name", DYNAMIC_BSZ_KEYS[0], *CHECKPOINTING_KEYS, SCORING_KEY,
             *(f"{role}.fsdp_config.fsdp_size" for role in FSDP_ROLES),
             *(f"{prefix}.fsdp_config.expert_parallel_size" for _, prefix in EP_ROLES))


@dataclass(frozen=True)
class AutoChoice:
    key: str
    value: Any
    reason: str

    def line(self) -> str:
        return f"{self.key}={self.value}: {self.reason}"


def model_shape(path: Any) -> tuple[ModelShape | None, str]:
    """The shape of the model at `path` when it can be read without loading it, else (None, why not)."""
    if path in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[path], ""
    if isinstance(path, str) and (Path(path) / "config.json").is_file():
        try:
            return read_model_shape(path), ""
        except ValueError as exc:
            return None, str(exc)
    return None, f"the size of {path!r} is unknown before it is loaded (no local config.json)"


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _set(cfg: Any, dotted: str, value: Any) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(_get(cfg, parent), leaf, value)


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _vllm_only(cfg: Any) -> list[str]:
    """The settings in use that only the vLLM rollout engine has."""
    r, rm = cfg.actor_rollout_ref.rollout, cfg.reward_model
    found = {"rollout.ignore_eos=true": r.ignore_eos, f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}":
             r.tensor_model_parallel_size != 1, f"rollout.load_format={r.load_format}": r.load_format != "auto",
             "rollout.engine_kwargs.vllm": bool(r.engine_kwargs.vllm),
             "reward_model.use_reward_loop=true": bool(rm.enable and rm.use_reward_loop)}
    return [k for k, used in found.items() if used]


def _rollout_choice(cfg: Any, shape: ModelShape | None, why: str, machine: Machine) -> AutoChoice:
    key = "actor_rollout_ref.rollout.name"
    arr = cfg.actor_rollout_ref
    if (arr.actor.router_replay.mode == "R3" or arr.rollout.enable_rollout_routing_replay) and not _vllm_only(cfg):
        return AutoChoice(key, "hf", "routing replay R3 replays the rollout's experts: the hf engine records them")
    if machine.device != "cpu":
        return AutoChoice(key, "vllm", f"device {machine.device}: vLLM's batched paged-attention engine")
    if shape is None:
        return AutoChoice(key, "vllm", f"{why}: vLLM, as verl")
    size = f"{shape.params / 1e6:.1f}M parameters"
    if shape.head_dim not in VLLM_CPU_HEAD_DIMS and not _vllm_only(cfg):
        return AutoChoice(key, "hf", f"head_dim={shape.head_dim}: vLLM's CPU attention has no kernel for it")
    if shape.params > HF_ROLLOUT_MAX_PARAMS:
        return AutoChoice(key, "vllm", f"{size} on cpu (over {HF_ROLLOUT_MAX_PARAMS / 1e6:.0f}M): vLLM's CPU kernels")
    if needs := _vllm_only(cfg):
        return AutoChoice(key, "vllm", f"{', '.join(needs)} needs vLLM")
    return AutoChoice(key, "hf", f"{size} on cpu (at most {HF_ROLLOUT_MAX_PARAMS / 1e6:.0f}M): the model's "
                                 "weights in rlsp's decoding loop, whose cost per decoding step is below vLLM's fixed "
                                 "per-step overhead")


def _fsdp_choices(cfg: Any, shapes: dict[str, tuple[ModelShape | None, str]], machine: Machine) -> list[AutoChoice]:
    out, key = [], "{}.fsdp_config.fsdp_size".format
    actor = _get(cfg, key("actor_rollout_ref.actor"))
    if _is_auto(actor):
        actor, reason = fsdp_value("actor", cfg, *shapes["actor"], machine)
        out.append(AutoChoice(key("actor_rollout_ref.actor"), actor, reason))
    if _is_auto(_get(cfg, key("actor_rollout_ref.ref"))):
        out.append(AutoChoice(key("actor_rollout_ref.ref"), actor, "the reference follows the actor"))
    if _is_auto(_get(cfg, key("critic.model"))):
        value, reason = fsdp_value("critic", cfg, *shapes["critic"], machine)
        out.append(AutoChoice(key("critic.model"), value, reason))
    if _is_auto(_get(cfg, key("reward_model.model"))):
        out.append(AutoChoice(key("reward_model.model"), -1, "the reward model's weights sharded over all ranks"))
    return out


def _dynamic_bsz_choice(cfg: Any) -> AutoChoice:
    actor = cfg.actor_rollout_ref.actor
    key, rows = "actor_rollout_ref.actor.use_dynamic_bsz", actor.ppo_micro_batch_size_per_gpu
    if rows != ActorConfig.ppo_micro_batch_size_per_gpu:
        return AutoChoice(key, False, f"ppo_micro_batch_size_per_gpu={rows} was set: micro-batches of {rows} rows")
    return AutoChoice(key, True, f"micro-batches filled to ppo_max_token_len_per_gpu={actor.ppo_max_token_len_per_gpu} "
                                 "tokens: fewer, fuller passes than fixed rows, the same result")


def _scoring_choice(cfg: Any) -> AutoChoice:
    if rollout_pool_enabled(cfg):
        return AutoChoice(SCORING_KEY, 1, "a rollout pool generates while the trainer trains: rule scoring in "
                                          "a process of its own, never queued behind an update")
    return AutoChoice(SCORING_KEY, 0, "rule scoring in the policy workers, on the rows each generated (they wait "
                                      "for the scores anyway): no scoring process to start")


def _checkpointing_choices(cfg: Any, shapes: dict[str, tuple[ModelShape | None, str]], machine: Machine,
                           image_tokens: int | None) -> list[AutoChoice]:
    out = []
    for role, key in zip(("actor", "critic"), CHECKPOINTING_KEYS):
        if _is_auto(_get(cfg, key)):
            value, reason = checkpointing_value(role, cfg, *shapes[role], machine, image_tokens)
            out.append(AutoChoice(key, value, reason))
    return out


def _illegal(cfg: Any, errors: list[str]) -> bool:
    """Report auto-able keys holding neither `auto` nor a value of their type; True when any does."""
    before = len(errors)
    for role in FSDP_ROLES:
        v = _get(cfg, f"{role}.fsdp_config.fsdp_size")
        if not _is_auto(v) and (isinstance(v, bool) or not isinstance(v, int)):
            errors.append(f"{role}.fsdp_config.fsdp_size={v!r} must be auto, -1 (all ranks) or a rank count >= 1")
    for key in CHECKPOINTING_KEYS:
        v = _get(cfg, key)
        if not _is_auto(v) and not isinstance(v, bool):
            errors.append(f"{key}={v!r} must be auto, true or false")
    actor = _get(cfg, DYNAMIC_BSZ_KEYS[0])
    for key in DYNAMIC_BSZ_KEYS:  # the others follow the actor's unless set (its problem is reported once)
        v = _get(cfg, key)
        if key != DYNAMIC_BSZ_KEYS[0] and v == actor:
            continue
        if not _is_auto(v) and not isinstance(v, bool):
            errors.append(f"{key}={v!r} must be {'auto, ' if key == DYNAMIC_BSZ_KEYS[0] else ''}true or false")
    v = _get(cfg, SCORING_KEY)
    if not _is_auto(v) and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        errors.append(f"{SCORING_KEY}={v!r} must be auto, 0 (the policy workers score) or a count of scoring "
                      "processes >= 1")
    return len(errors) > before


def resolve_auto(cfg: Any, errors: list[str], machine: Machine | None = None,
                 image_tokens: int | None = None) -> list[AutoChoice]:
    """Set every `auto` key of `cfg` (in place) to its value for this model and `machine` (None: the one
    this runs on); returns the choices the run uses (none when nothing is `auto`). `image_tokens`: the largest
    training row's image tokens (rlsp.data.image_count; None: not counted, rlsp.config.auto_vision bounds them)."""
    if _illegal(cfg, errors) or not any(_is_auto(_get(cfg, key)) for key in AUTO_KEYS):
        return []  # nothing to decide: no model or machine is read
    arr, choices = cfg.actor_rollout_ref, []
    actor_shape = model_shape(arr.model.path)
    critic_path = cfg.critic.model.path or arr.model.path
    shapes = {"actor": actor_shape, "critic": model_shape(critic_path) if critic_path != arr.model.path else actor_shape}
    machine = machine or machine_facts(str(cfg.trainer.device), int(cfg.trainer.n_gpus_per_node))
    if _is_auto(arr.rollout.name):
        choices.append(_rollout_choice(cfg, *actor_shape, machine))
        arr.rollout.name = choices[-1].value  # the fsdp rule reads it (vLLM's share of GPU memory)
    choices += _fsdp_choices(cfg, shapes, machine)
    if _is_auto(arr.actor.use_dynamic_bsz):
        choices.append(_dynamic_bsz_choice(cfg))
    if _is_auto(_get(cfg, SCORING_KEY)):
        choices.append(_scoring_choice(cfg))
    for c in choices:  # the checkpointing rule reads the sharding and micro-batches chosen above
        _set(cfg, c.key, c.value)
    gc = [AutoChoice(*c) for c in ep_choices(cfg, shapes, train_memory(cfg, machine))]  # reads fsdp_size
    gc += _checkpointing_choices(cfg, shapes, machine, image_tokens)
    for c in gc:
        _set(cfg, c.key, c.value)
    choices += gc
    return [c for c in choices if _in_use(cfg, c.key)]


def _in_use(cfg: Any, key: str) -> bool:
    """Whether the run reads `key` (the critic's and the legacy reward model's only when they exist)."""
    if key.startswith("critic."):
        return cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS
    if key.startswith("reward_model.model."):
        return bool(cfg.reward_model.enable and not cfg.reward_model.use_reward_loop)
    if key == "actor_rollout_ref.ref.fsdp_config.fsdp_size":
        return has_reference(cfg)
    return True
