"""What a resume checks, in one place, before any worker has the run's config (docs/checkpoints.md, "What a resume checks"):
the resume stage of the check registry (rlsp.config.checks; `resume_plan` runs it).

`check_resume(cfg)` runs after preflight (the model path is a local directory by then) and returns a
`ResumePlan`, or raises ValueError naming what is wrong and the way out:

* which checkpoint: `resolve_resume` picks it from trainer.resume_mode; if one of its files is
  missing, truncated or unreadable (`damaged_file`), resume_mode=auto names the file and falls back
  to the newest whole checkpoint before it, resume_mode=resume_path refuses;
* whether it loads under this command: the model architecture it was trained with (its
  actor/huggingface/config.json; for checkpoints without one, the model its config.yaml names), the
  critic (an algorithm that adds or drops it), and the LoRA keys that change the saved tensors (LoRA
  switched on or off, another rank, adapted layers or starting adapter);
* the settings that differ from its config.yaml and change the run's course (learning rate, batch
  sizes, ...): listed in one warning; layout and bookkeeping keys (COURSE_NEUTRAL) are not;
* whether anything is left to do: a checkpoint at or past trainer.total_training_steps.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig, PretrainedConfig

from rlsp.config.checks import CheckContext, register, run_checks
from rlsp.config.layout import CRITIC_ESTIMATORS, ParallelLayout
from rlsp.config.lora_keys import lora_enabled
from rlsp.config.schema import RLSPConfig
from rlsp.data.vision_run import tower_switch_problem
from rlsp.models.family_checks import text_model_config
from rlsp.run.checkpoint import STEP_DIR, TrainerState, complete_steps, damaged_file, resolve_resume, step_dir
from rlsp.utils.dicts import flatten
from rlsp.utils.logging import get_logger

log = get_logger("rlsp.resume")
# The fields that decide whether saved weights load into a model built from a config.
ARCH_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
# The LoRA keys decide which tensors a checkpoint holds: with LoRA on (rlsp.config.lora_keys.lora_enabled) only the
# adapters are saved, the frozen base is re-read from model.path; a change of them is refused (absent
# keys compare equal). LORA_SWITCHES turn LoRA on and decide its rank: refused whenever LoRA is on before or
# after. lora_adapter_path belongs here because it is where the adapters *start*, and its
# adapter_config.json sets their rank and targets; a resume continues the checkpoint's own adapters, so
# another starting adapter would either be overwritten by the checkpoint's weights without a word (same
# layout) or fail to load in the workers (another one). Starting from another adapter is a new run.
LORA_SWITCHES = ("actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora_adapter_path")
# Which layers carry adapters: refused while LoRA stays on; without LoRA they are unused.
LORA_LAYERS = ("actor_rollout_ref.model.target_modules", "actor_rollout_ref.model.exclude_modules")
LOAD_DECIDING = LORA_SWITCHES + LORA_LAYERS
# Keys that do not change what is trained: layout, micro-batching (the loss is exact whatever they are),
# memory and bookkeeping. Everything else that differs from the checkpoint's config.yaml is listed.
COURSE_NEUTRAL = (
    "trainer.project_name", "trainer.experiment_name", "trainer.device", "trainer.nnodes", "trainer.n_gpus_per_node",
    "trainer.total_epochs", "trainer.total_training_steps", "trainer.test_freq", "trainer.val_before_train",
    "trainer.default_local_dir", "trainer.logger", "trainer.cache_dir", "trainer.ray_address", "trainer.sp_self_check*",
    "trainer.plot", "trainer.save_*", "trainer.resume_*", "trainer.max_*_ckpt_to_keep", "trainer.balance_batch",
    "data.val_files", "*.val_kwargs.*", "*sequence_parallel_size", "*.tensor_model_parallel_size",
    "*.sequence_parallel", "*.sequence_parallel_adaptive", "*.fsdp_config.fsdp_size", "*.fsdp_config.*offload*",
    "*.tiled_mlp.*", "*.lean_rmsnorm", "*.enable_activation_offload", "*micro_batch_size_per_gpu", "*use_dynamic_bsz",
    "*max_token_len_per_gpu", "*.logprob_chunk_size", "*.enable_gradient_checkpointing",
    "actor_rollout_ref.actor.reuse_update_logprobs", "critic.colocate", "critic.nnodes", "critic.n_gpus_per_node",
    "actor_rollout_ref.rollout.cpu_kvcache_space_gib", "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.enforce_eager", "*.use_remove_padding", "*.use_shm", "*.use_fused_kernels",
    "*.fused_kernel_options.*", "*.strategy", "actor_rollout_ref.rollout.mode", "data.return_raw_chat",
    "trainer.use_legacy_worker_impl",
)
MODEL_KEYS = ("actor_rollout_ref.model.path", "critic.model.path")  # compared by architecture instead


RESUME_PLAN = "resume_plan"  # where the resume check leaves its plan in the check context


@dataclass
class ResumePlan:
    """Where a run continues from: `path` None starts fresh; `complete` means nothing is left to train."""

    path: str | None
    step: int = 0
    complete: bool = False


def check_resume(cfg: DictConfig) -> ResumePlan:
    """The checkpoint this command continues, after every check a resume needs (see the module docstring)."""
    path = resolve_resume(cfg)
    if path is None:
        return ResumePlan(None)
    path = _whole_checkpoint(cfg, path)
    saved = _saved_config(path)
    where = (f"trainer.resume_from_path={path!r}" if cfg.trainer.resume_mode == "resume_path"
             else f"run dir trainer.default_local_dir={cfg.trainer.default_local_dir!r}")
    problems = incompatibilities(cfg, path, saved)
    if problems:
        raise ValueError(
            f"cannot resume: {where} holds checkpoint {os.path.basename(path)}, which this command cannot load:\n  - "
            + "\n  - ".join(problems) + "\nTo train this command's setup from scratch, give it a new "
            "trainer.default_local_dir (trainer.resume_mode=disable always starts fresh, into an empty directory); "
            "to continue the checkpoint, use the settings it was written with.")
    changed = changed_settings(cfg, saved)
    if changed:
        log.warning("resuming %s with settings that differ from its config.yaml (the run continues with this "
                    "command's values):\n  %s", path, "\n  ".join(changed))
    step, total = TrainerState.read(path).step, cfg.trainer.total_training_steps
    # total None: the run length comes from the dataset (verl's rule), which the driver reads first
    return ResumePlan(path, step, complete=total is not None and step >= total)


@register("resume", "resume")
def _check_resume(cfg: DictConfig, ctx: CheckContext, errors: list[str]) -> None:
    try:
        ctx.results[RESUME_PLAN] = check_resume(cfg)
    except ValueError as exc:
        errors.append(str(exc))


def resume_plan(cfg: DictConfig, layout: ParallelLayout | None) -> ResumePlan:
    """Run the resume stage; the plan it decided, or a ValueError naming every problem."""
    ctx = CheckContext(layout)
    errors = run_checks(cfg, "resume", ctx)
    if errors:
        raise ValueError("\n".join(errors))
    return ctx.results[RESUME_PLAN]


def describe_resume(cfg: DictConfig, layout: ParallelLayout | None) -> str:
    """rlsp.check's "resume" line: what the run dir holds and what this command does with it (the resume stage
    runs unless the run length is still unknown and the run dir exists); a ValueError as `resume_plan`'s."""
    run_dir = cfg.trainer.default_local_dir
    if cfg.trainer.total_training_steps is None and os.path.isdir(run_dir):
        return f"run dir {run_dir} exists; not checked: the run length is unknown without the data"
    plan = resume_plan(cfg, layout)
    if not os.path.isdir(run_dir):
        return f"run dir {run_dir} does not exist: a fresh run"
    what = ("a fresh run" if plan.path is None else
            f"complete at step {plan.step}: nothing to train" if plan.complete else f"continues {plan.path}")
    return f"run dir {run_dir}: {what}"


def _saved_config(path: str) -> dict[str, Any] | None:
    try:
        return OmegaConf.to_container(OmegaConf.load(os.path.join(path, "config.yaml")), resolve=True)
    except Exception:  # damaged_file names it; here it only means "unknown"
        return None


def _has_critic(config: dict[str, Any]) -> bool:
    return _get(config, "algorithm.adv_estimator") in CRITIC_ESTIMATORS


def _whole_checkpoint(cfg: DictConfig, path: str) -> str:
    """`path` if every file it needs is whole; else (resume_mode=auto) the newest whole one before it."""
    saved = _saved_config(path)
    critic = _has_critic(saved) if saved is not None else os.path.isdir(os.path.join(path, "critic"))
    parts = ("actor", "critic") if critic else ("actor",)
    damage = damaged_file(path, parts)
    if damage is None:
        return path
    if cfg.trainer.resume_mode == "resume_path":
        raise ValueError(f"trainer.resume_from_path={path!r} cannot be resumed: {damage}. Point it at another "
                         "global_step_<N> directory.")
    run_dir = cfg.trainer.default_local_dir
    newest = int(STEP_DIR.match(os.path.basename(path)).group(1))  # auto resumes a global_step_<N> of run_dir
    for step in reversed([s for s in complete_steps(run_dir) if s < newest]):
        older = os.path.abspath(step_dir(run_dir, step))
        if damaged_file(older, parts) is None:
            log.warning("checkpoint %s cannot be resumed: %s; resuming from %s, the newest whole checkpoint "
                        "(the steps after it are trained again)", path, damage, older)
            return older
    raise ValueError(f"cannot resume run dir trainer.default_local_dir={run_dir!r}: {damage}, and no older "
                     "checkpoint there is whole. Start over in a new trainer.default_local_dir.")


def incompatibilities(cfg: DictConfig, path: str, saved: dict[str, Any]) -> list[str]:
    """Why checkpoint `path` (whose config.yaml is `saved`) cannot load under `cfg`; empty when it can."""
    current = OmegaConf.to_container(cfg, resolve=True)
    recorded = _recorded_model(path, saved)
    actor_path = cfg.actor_rollout_ref.model.path
    problems = []
    if recorded is not None:
        problems += _arch_problem("actor", _get(saved, "actor_rollout_ref.model.path"), recorded, actor_path)
    if (tower := tower_switch_problem(cfg, os.path.join(path, "actor", "huggingface"))) is not None:
        problems.append(tower)
    if _has_critic(saved) != _has_critic(current):
        had, has = (_get(c, "algorithm.adv_estimator") for c in (saved, current))
        problems.append(
            f"its run {'had a' if _has_critic(saved) else 'had no'} critic (algorithm.adv_estimator={had!r}); this "
            f"command {'has one' if _has_critic(current) else 'has none'} (algorithm.adv_estimator={has!r}). To "
            "start another algorithm from its actor, export it (python -m rlsp.export <checkpoint> <dir>) and use "
            "that as actor_rollout_ref.model.path in a new run dir")
    elif _has_critic(saved):
        saved_critic = _get(saved, "critic.model.path")
        old = _read_config(saved_critic) if saved_critic else recorded
        if old is not None:
            problems += _arch_problem("critic", saved_critic or "(the actor's)", old, cfg.critic.model.path or actor_path)
    return problems + _lora_problems(saved, current)


def _lora_problems(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The LoRA keys whose change changes what the checkpoint holds (see LORA_SWITCHES)."""
    was, now = (lora_enabled(SimpleNamespace(**{k.rpartition(".")[2]: _get(c, k) for k in LORA_SWITCHES}))
                for c in (saved, current))
    if not was and not now:
        return []  # full fine-tuning both times: the adapter keys are unused
    def why(key: str) -> str:
        if was != now:
            return ("the checkpoint holds only LoRA adapters (its base is model.path); this command trains the whole "
                    "model" if was else "the checkpoint holds the whole model's weights; this command trains LoRA adapters")
        if key == LORA_SWITCHES[1]:
            return "a resume continues the checkpoint's adapters; another starting adapter is a new run"
        return "the checkpoint holds the adapters these keys laid out; adapters laid out otherwise do not load from it"

    keys = LOAD_DECIDING if was and now else LORA_SWITCHES
    return [f"{key} was {_get(saved, key)!r}; this command sets {_get(current, key)!r} ({why(key)})"
            for key in keys if _get(saved, key) != _get(current, key)]


def _arch_problem(role: str, old_name: str | None, old: PretrainedConfig, new_path: str) -> list[str]:
    new = _read_config(new_path)
    if new is None:
        return [f"{role} model {new_path!r} has no readable config.json"]
    a, b = arch(old), arch(new)
    if a == b:
        return []
    diff = ", ".join(f"{k} {a[k]} -> {b[k]}" for k in ARCH_FIELDS if a[k] != b[k])
    key = "actor_rollout_ref.model.path" if role == "actor" else "critic.model.path"
    return [f"it was trained from {role} model {old_name} ({describe(a)}); this command trains {key}="
            f"{new_path} ({describe(b)}) — {diff}"]


def arch(config: PretrainedConfig) -> dict[str, Any]:
    """The ARCH_FIELDS of a model config (head_dim derived where the config leaves it implicit)."""
    out = {k: getattr(config, k, None) for k in ARCH_FIELDS}
    if out["head_dim"] is None and out["hidden_size"] and out["num_attention_heads"]:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    return out


def describe(a: dict[str, Any]) -> str:
    tied = ", tied embeddings" if a["tie_word_embeddings"] else ""
    return (f"{a['model_type']}: {a['num_hidden_layers']} layers, {a['num_attention_heads']} attention / "
            f"{a['num_key_value_heads']} kv heads of {a['head_dim']}, hidden {a['hidden_size']}, intermediate "
            f"{a['intermediate_size']}, vocab {a['vocab_size']}{tied}")


def _recorded_model(path: str, saved: dict[str, Any]) -> PretrainedConfig | None:
    """The model config the checkpoint was trained with: the copy it holds, else the one its run names."""
    config = _read_config(os.path.join(path, "actor", "huggingface"))
    if config is None:
        config = _read_config(_get(saved, "actor_rollout_ref.model.path"))
    if config is None:
        log.warning("cannot tell which model checkpoint %s was trained with (no actor/huggingface/config.json, "
                    "and its config.yaml names no readable model); its architecture is not checked", path)
    return config


def _read_config(path: str | None) -> PretrainedConfig | None:
    if not path or not os.path.exists(os.path.join(path, "config.json")):
        return None
    try:  # a qwen3_5(_moe) wrapper as its text model: what the checkpoint's actor/huggingface/config.json records
        return text_model_config(AutoConfig.from_pretrained(path))
    except (OSError, ValueError):
        return None


def changed_settings(cfg: DictConfig, saved: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every setting that differs from the checkpoint's config and changes what is
    trained. A key the checkpoint's config lacks (added to rlsp since) compares with its default."""
    current = flatten(OmegaConf.to_container(cfg, resolve=True))
    before = flatten(saved)
    defaults = OmegaConf.structured(RLSPConfig)
    out = []
    for key, value in current.items():
        if key in MODEL_KEYS or key in LOAD_DECIDING or any(fnmatch.fnmatchcase(key, p) for p in COURSE_NEUTRAL):
            continue
        old = before[key] if key in before else OmegaConf.select(defaults, key, default=None)
        if old != value:
            out.append(f"{key}: {old!r} -> {value!r}")
    return out


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree
