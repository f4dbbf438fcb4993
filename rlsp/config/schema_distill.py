"""Schema of on-policy distillation (`distillation.*`, verl's keys and meaning). No torch import here.

The student (the actor) samples; one or more frozen teachers score the student's own tokens; the
per-token divergence estimate between student and teacher becomes a per-token advantage term (see
rlsp/algos/distillation.py and docs/algorithms.md). Checked by rlsp.config.validate_distill.

`teacher_models` maps a name (any) to one teacher; rows are routed to the teacher whose `key` equals
the row's `teacher_key` field (data_source). It is an open mapping so that `+distillation.teacher_models.
<name>.model_path=...` adds teachers as in verl; every entry is checked against `TeacherModelConfig`
(unknown keys named) at start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# verl's name of the single default teacher entry; with more entries an unconfigured default is dropped.
DEFAULT_TEACHER = "teacher_model"


@dataclass
class TeacherInferenceConfig:
    """verl serves each teacher with an inference engine; rlsp runs it as a frozen forward in the training
    engine (the reference model's way), so only the keys below exist, with the effect each comment says."""

    name: str = "vllm"  # vllm | sglang | hf: no effect (every value gives the same forward pass)
    dtype: str | None = None  # compute dtype of the teacher; None = actor_rollout_ref.model.dtype
    tensor_model_parallel_size: int = 1  # verl's engine degree (>= 1): places nothing, the teacher runs the reference's layout (Ulysses ok)
    data_parallel_size: int = 1  # must be 1 (the policy workers' dp is the teacher's)
    pipeline_model_parallel_size: int = 1  # must be 1
    max_model_len: int | None = None  # checked: max_prompt_length + max_response_length + 1 must fit
    # Serving knobs without effect on a forward pass with no KV cache (accepted so verl commands port).
    gpu_memory_utilization: float = 0.5
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    enforce_eager: bool = True
    free_cache_engine: bool = True


@dataclass
class TeacherModelConfig:
    key: str | None = None  # value of the rows' `teacher_key` field routed to this teacher
    model_path: str | None = None  # local HF directory (or builtin://tiny-qwen2[...]) of the teacher
    num_replicas: int = 0  # verl's replica count in the teacher pool (>= 0): rlsp colocates, it places nothing
    inference: TeacherInferenceConfig = field(default_factory=TeacherInferenceConfig)


def default_teacher_entry() -> dict[str, Any]:
    """An unconfigured teacher entry as a plain dict (the open `teacher_models` mapping holds dicts)."""
    return dataclasses.asdict(TeacherModelConfig())


@dataclass
class DistillationLossConfig:
    loss_mode: str = "k3"  # k1|kl, abs, k2|mse, k3|low_var_kl (sampled-token estimators); top-k modes refused
    topk: int | None = 128  # read only by verl's top-k loss modes (refused here)
    use_task_rewards: bool = True  # add the task advantage (estimator on the task reward) to the distillation term
    distillation_loss_coef: float = 1.0  # weight of the distillation term when use_task_rewards=true
    loss_max_clamp: float | None = 10.0  # per-token divergence clamped to [-c, c] (k1 can be negative)
    log_prob_min_clamp: float | None = -10.0  # student and teacher logprobs floored here before the estimator
    use_policy_gradient: bool = True  # true: -divergence is the advantage (rlsp implements this form only)
    policy_loss_mode: str = "vanilla"  # verl supports vanilla only; rlsp too
    clip_ratio: float = 0.2  # must give the actor's clip range: one clipped loss runs on the summed advantage
    clip_ratio_low: float = 0.2  # must equal the actor's effective clip_ratio_low
    clip_ratio_high: float = 0.2  # must equal the actor's effective clip_ratio_high


@dataclass
class DistillationConfig:
    enabled: bool = False  # on-policy distillation: teachers score the student's samples (docs/algorithms.md)
    n_gpus_per_node: int = 0  # verl's separate teacher pool (>= 0): rlsp colocates the teachers, it places nothing
    nnodes: int = 0  # >= 0, likewise (colocated)
    enable_resource_pool: bool = False  # must be false (colocated)
    teacher_key: str = "data_source"  # the row field matched against each teacher's `key`
    teacher_models: dict[str, Any] = field(default_factory=lambda: {DEFAULT_TEACHER: default_teacher_entry()})  # name -> {key, model_path, num_replicas, inference.*}; more: +distillation.teacher_models.<name>.model_path=...
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
