"""Start-up checks of on-policy distillation (`distillation.*`, rlsp.config.schema_distill); the teacher table
the trainer and the teacher role read is resolved in rlsp.config.run_spec.

Arithmetic on config values only (no torch, no files): called by `validate_config`, which collects every
message into one error. The checks that need files (teacher/student vocabularies, the data_source values
of the data) run in rlsp.step.distill before any worker has the run's config.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlsp.config.choices import DTYPE_NAMES, KL_ESTIMATOR_NAMES
from rlsp.config.run_spec import configured_teachers, distillation_enabled
from rlsp.config.schema_distill import TeacherInferenceConfig, TeacherModelConfig

PREFIX = "distillation"
# verl's loss modes that need the teachers' top-k distributions (an inference server's prompt logprobs);
# rlsp's teacher returns the logprob of the sampled token only.
TOPK_LOSS_MODES = ("forward_kl_topk", "reverse_kl_topk", "jsd_topk")
TEACHER_KEYS = ("data_source",)  # row fields a teacher can be routed by (the rows' string metadata)
INFERENCE_NAMES = ("vllm", "sglang", "hf")
ONE_ONLY = ("data_parallel_size", "pipeline_model_parallel_size")
# verl's teacher pool (distillation.n_gpus_per_node x nnodes, each teacher's num_replicas x its inference tensor
# parallel degree) only places the teachers; rlsp colocates them on the policy workers instead, where they score the
# same tokens with the same weights: accepted (a note says so, rlsp.config.verl_notes_0_9), and checked as verl does.
POOL_KEYS = ("n_gpus_per_node", "nnodes")


def _entry(name: str, raw: Any, errors: list[str]) -> Any | None:
    """`raw` merged onto the TeacherModelConfig schema (unknown keys and bad types named), or None."""
    base = OmegaConf.structured(TeacherModelConfig)
    try:
        return OmegaConf.merge(base, raw if isinstance(raw, DictConfig | dict) else {})
    except Exception as exc:  # omegaconf's messages name the key; add where it lives and what is legal
        legal = ", ".join(list(base.keys()) + [f"inference.{k}" for k in OmegaConf.structured(TeacherInferenceConfig)])
        first = str(exc).splitlines()[0]
        errors.append(f"{PREFIX}.teacher_models.{name}: {first}; legal keys of a teacher: {legal}")
        return None


def _check_inference(where: str, inf: Any, cfg: Any, errors: list[str]) -> None:
    if inf.name not in INFERENCE_NAMES:
        errors.append(f"{where}.name={inf.name!r} is not supported; legal: {', '.join(INFERENCE_NAMES)} (rlsp runs "
                      "every teacher as a frozen forward in its training engine, whatever the name)")
    if inf.dtype is not None and inf.dtype not in DTYPE_NAMES:
        errors.append(f"{where}.dtype={inf.dtype!r}; legal: {', '.join(DTYPE_NAMES)} or null (the student's dtype)")
    for key in ONE_ONLY:
        if int(inf[key]) != 1:
            errors.append(f"{where}.{key}={inf[key]} is not supported: the teacher runs on the policy workers in the "
                          "reference model's layout (its Ulysses degree included); set it to 1")
    if int(inf.tensor_model_parallel_size) < 1:
        errors.append(f"{where}.tensor_model_parallel_size={inf.tensor_model_parallel_size} must be >= 1")
    need = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length) + 1
    if inf.max_model_len is not None and int(inf.max_model_len) < need:
        errors.append(f"{where}.max_model_len={inf.max_model_len} < max_prompt_length + max_response_length + 1 = "
                      f"{need}: the teacher reads the student's whole prompt and response")


def _check_teacher(name: str, t: Any, cfg: Any, errors: list[str]) -> None:
    where = f"{PREFIX}.teacher_models.{name}"
    if not t.model_path:
        errors.append(f"{where}.model_path is missing: give the teacher's model directory "
                      f"({where}.model_path=/path/to/teacher)")
    if int(t.num_replicas) < 0:
        errors.append(f"{where}.num_replicas={t.num_replicas} must be >= 0 (verl's replicas in the teacher pool; "
                      "rlsp colocates the teacher on the policy workers whatever it says)")
    _check_inference(f"{where}.inference", t.inference, cfg, errors)


def _check_routes(teachers: dict[str, Any], errors: list[str]) -> None:
    keys = [t.key for t in teachers.values()]
    if len(teachers) > 1 and None in keys:
        missing = [n for n, t in teachers.items() if t.key is None]
        errors.append(f"{PREFIX}.teacher_models: with several teachers each needs a `key` (the data_source value "
                      f"routed to it); missing for: {', '.join(missing)}")
    seen: dict[str, str] = {}
    for name, t in teachers.items():
        if t.key is not None and t.key in seen:
            errors.append(f"{PREFIX}.teacher_models: key {t.key!r} is given to both {seen[t.key]} and {name}; "
                          "each routing key names one teacher")
        seen.setdefault(t.key, name)


def _check_loss(cfg: Any, errors: list[str]) -> None:
    loss, w = cfg.distillation.distillation_loss, f"{PREFIX}.distillation_loss"
    if loss.loss_mode in TOPK_LOSS_MODES:
        errors.append(f"{w}.loss_mode={loss.loss_mode!r} is not supported: it needs the teachers' top-k "
                      f"distributions; rlsp scores the sampled token only; legal: {', '.join(KL_ESTIMATOR_NAMES)}")
    elif loss.loss_mode not in KL_ESTIMATOR_NAMES:
        errors.append(f"{w}.loss_mode={loss.loss_mode!r} is unknown; legal: {', '.join(KL_ESTIMATOR_NAMES)}")
    if not loss.use_policy_gradient:
        errors.append(f"{w}.use_policy_gradient=false (the divergence back-propagated as a supervised loss) is not "
                      "supported: rlsp uses the negative divergence as a per-token advantage; set it to true")
    if loss.policy_loss_mode != "vanilla":
        errors.append(f"{w}.policy_loss_mode={loss.policy_loss_mode!r}; legal: vanilla (as in verl)")
    for key in ("loss_max_clamp",):
        if loss[key] is not None and float(loss[key]) <= 0:
            errors.append(f"{w}.{key}={loss[key]} must be > 0 or null")
    if loss.log_prob_min_clamp is not None and float(loss.log_prob_min_clamp) >= 0:
        errors.append(f"{w}.log_prob_min_clamp={loss.log_prob_min_clamp} must be < 0 (a log-probability) or null")
    _check_clip(cfg, errors)


def _check_clip(cfg: Any, errors: list[str]) -> None:
    """verl adds a second clipped loss for the distillation term; rlsp adds the term to the advantage of the
    actor's one clipped loss, which is the same objective when both use the same clip range and loss."""
    loss, actor, w = cfg.distillation.distillation_loss, cfg.actor_rollout_ref.actor, f"{PREFIX}.distillation_loss"
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    if (float(loss.clip_ratio_low), float(loss.clip_ratio_high)) != (float(low), float(high)):
        errors.append(f"{w}.clip_ratio_low/high=({loss.clip_ratio_low}, {loss.clip_ratio_high}) differ from the "
                      f"actor's clip range ({low}, {high}): rlsp applies one clipped loss to the task plus distillation "
                      "advantage; set both to the same values")
    pl = actor.policy_loss
    mode = pl if isinstance(pl, str) else pl.loss_mode
    if mode != "vanilla":
        errors.append(f"actor_rollout_ref.actor.policy_loss={mode!r} with distillation: the distillation term is a "
                      "vanilla clipped policy-gradient term (verl's only mode), and rlsp adds it to the actor's loss "
                      "advantage; legal: vanilla")


def check_distillation(cfg: Any, errors: list[str]) -> bool:
    """Every `distillation.*` problem into `errors`; True when teachers are placed on the policy workers
    (the layout's `teachers`)."""
    if not distillation_enabled(cfg):
        return False
    _check_section(cfg, errors)
    return True


def _check_section(cfg: Any, errors: list[str]) -> None:
    d = cfg.distillation
    for key in POOL_KEYS:
        if int(d[key]) < 0:
            errors.append(f"{PREFIX}.{key}={d[key]} must be >= 0 (verl's teacher pool; rlsp colocates the teachers "
                          "on the policy workers whatever it says)")
    if d.enable_resource_pool:
        errors.append(f"{PREFIX}.enable_resource_pool=true is not supported: the teachers share the policy workers")
    if d.teacher_key not in TEACHER_KEYS:
        errors.append(f"{PREFIX}.teacher_key={d.teacher_key!r} is not a row field rlsp routes by; legal: "
                      f"{', '.join(TEACHER_KEYS)}")
    _check_loss(cfg, errors)
    entries = {str(n): _entry(str(n), raw, errors) for n, raw in d.teacher_models.items()}
    teachers = configured_teachers(entries)
    if not teachers:
        errors.append(f"{PREFIX}.teacher_models is empty: give at least one teacher (model_path)")
    for name, t in teachers.items():
        if t is not None:
            _check_teacher(name, t, cfg, errors)
    if all(t is not None for t in teachers.values()):
        _check_routes(teachers, errors)
        _check_pool(d, teachers, errors)


def _check_pool(d: Any, teachers: dict[str, Any], errors: list[str]) -> None:
    """verl's arithmetic of its teacher pool, when one is given (n_gpus_per_node x nnodes > 0): one teacher's
    tensor-parallel degree divides the pool, several teachers' num_replicas x degree add up to it. rlsp places no
    pool, but a command verl refuses is refused here too, with verl's reason."""
    pool = int(d.n_gpus_per_node) * int(d.nnodes)
    if pool <= 0:
        return
    where = f"{PREFIX}.n_gpus_per_node x {PREFIX}.nnodes = {d.n_gpus_per_node} x {d.nnodes} = {pool}"
    if len(teachers) == 1:
        ((name, t),) = teachers.items()
        tp = int(t.inference.tensor_model_parallel_size)
        if tp > 0 and pool % tp:
            errors.append(f"{PREFIX}.teacher_models.{name}.inference.tensor_model_parallel_size={tp} does not divide "
                          f"verl's teacher pool ({where}), which verl refuses; legal sizes divide it")
        return
    used = sum(int(t.num_replicas) * int(t.inference.tensor_model_parallel_size) for t in teachers.values())
    if used != pool:
        errors.append(f"{PREFIX}.teacher_models: num_replicas x inference.tensor_model_parallel_size add up to {used}, "
                      f"not verl's teacher pool ({where}), which verl refuses; make them match (rlsp itself "
                      "colocates the teachers on the policy workers)")

