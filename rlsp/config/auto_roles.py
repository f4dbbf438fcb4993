"""The `auto` rules that weigh one trainable role's memory (rlsp.config.auto resolves the keys): FSDP's size
(`fsdp_config.fsdp_size`: the whole model on every rank while its training state takes at most 1/REPLICATE_SHARE of
the rank's memory) and gradient checkpointing (`model.enable_gradient_checkpointing`: rlsp.config.auto_memory's rule,
with the vision tower's activations for a vision-language actor's image tokens, rlsp.config.auto_vision). A role is
'actor' (actor_rollout_ref.actor and .model, the reference's weights beside it) or 'critic' (critic, critic.model).

No torch.
"""

from __future__ import annotations

from typing import Any

from rlsp.config.auto_memory import checkpointing_choice, micro_batch_tokens
from rlsp.config.auto_vision import row_images
from rlsp.config.layout_build import has_reference
from rlsp.config.machine import GIB, Machine
from rlsp.config.model_shape import ModelShape

REPLICATE_SHARE = 4  # the rest of a rank's memory: activations, the reference's forward, buffers
STATE_BYTES, LORA_STATE_BYTES, REFERENCE_BYTES = 16, 4, 4


def offloaded(fsdp: Any) -> bool:
    return bool(fsdp.param_offload or fsdp.optimizer_offload or fsdp.offload_policy)


def role_section(cfg: Any, role: str) -> Any:
    """The role's training section: actor_rollout_ref.actor or critic."""
    return cfg.actor_rollout_ref.actor if role == "actor" else cfg.critic


def role_fsdp_config(cfg: Any, role: str) -> Any:
    return cfg.actor_rollout_ref.actor.fsdp_config if role == "actor" else cfg.critic.model.fsdp_config


def train_memory(cfg: Any, machine: Machine) -> float | None:
    """A rank's memory for training: on cuda what the colocated vLLM engine's share leaves."""
    if machine.rank_memory is None:
        return None
    if machine.device == "cuda" and cfg.actor_rollout_ref.rollout.name == "vllm":
        return machine.rank_memory * (1 - float(cfg.actor_rollout_ref.rollout.gpu_memory_utilization))
    return machine.rank_memory


def whole_state(cfg: Any, role: str, shape: ModelShape) -> float:
    """Training state of the whole model on one rank of the role's tp split (plus the reference's weights)."""
    lora = role == "actor" and cfg.actor_rollout_ref.model.lora_rank > 0
    ref = REFERENCE_BYTES if role == "actor" and has_reference(cfg) else 0
    tp = max(1, int(role_section(cfg, role).tensor_model_parallel_size))
    return shape.params * ((LORA_STATE_BYTES if lora else STATE_BYTES) + ref) / tp


def fsdp_value(role: str, cfg: Any, shape: ModelShape | None, why: str, machine: Machine) -> tuple[int, str]:
    """fsdp_size for a trainable role ('actor' or 'critic'), with the reason."""
    if offloaded(role_fsdp_config(cfg, role)):
        return -1, "FSDP offload asked for: parameters sharded over all ranks (FSDP)"
    memory = train_memory(cfg, machine)
    if shape is None or memory is None:
        return -1, f"{why or machine.source}: sharded over all ranks (verl's default)"
    state = whole_state(cfg, role, shape)
    fits = state * REPLICATE_SHARE <= memory
    text = (f"{shape.params / 1e6:.1f}M parameters: {state / GIB:.2f} GiB of training state per rank "
            f"{'<=' if fits else '>'} 1/{REPLICATE_SHARE} of {memory / GIB:.1f} GiB ({machine.source})")
    if fits:
        return 1, f"{text}: every rank holds the whole model, only gradients are reduced"
    return -1, f"{text}: sharded over all ranks (FSDP)"


def checkpointing_value(role: str, cfg: Any, shape: ModelShape | None, why: str, machine: Machine,
                        image_tokens: int | None = None) -> tuple[bool, str]:
    """enable_gradient_checkpointing for a trainable role, with the reason (rlsp.config.auto_memory); a role on a
    vision-language model (the actor; a critic loaded with its tower) counts its tower's activations for `image_tokens`
    a row (rlsp.config.auto_vision)."""
    model = cfg.actor_rollout_ref.model if role == "actor" else cfg.critic.model
    if model.enable_activation_offload:
        return True, "enable_activation_offload=true keeps the checkpointed layer inputs in host memory: on"
    section, data = role_section(cfg, role), cfg.data
    world = section.nnodes * section.n_gpus_per_node if role == "critic" and not cfg.critic.colocate else \
        cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    tp, sp = (max(1, int(section[k])) for k in ("tensor_model_parallel_size", "ulysses_sequence_parallel_size"))
    sp *= max(1, int(section.ring_sequence_parallel_size))
    size = role_fsdp_config(cfg, role).fsdp_size
    state = 0.0 if shape is None else whole_state(cfg, role, shape) / (max(1, world // tp) if size == -1 else size)
    prompt, response = int(data.max_prompt_length), int(data.max_response_length)
    tokens = micro_batch_tokens(section, prompt, response)
    dtype = str(model.dtype or cfg.actor_rollout_ref.model.dtype)  # the critic: the actor's unless set
    images = row_images(shape, image_tokens, prompt)  # a vision-language critic encodes the same rows' images
    return checkpointing_choice(shape, why, machine, train_memory(cfg, machine), state, tokens, dtype, tp * sp,
                                images, prompt + response)
