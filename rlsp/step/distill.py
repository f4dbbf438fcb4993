"""On-policy distillation in the driver loop (`distillation.enabled`): start-up checks that need files, the
teachers' logprobs for a batch, and the distillation term added to the advantages.

After the task advantages are computed (rlsp.trainer.ray_trainer), `Distillation.apply` asks the
teachers (rlsp.workers.roles.teacher) for the logprob of every sampled token, then has the same workers
turn student minus teacher into the per-token divergence d and set advantages = A_task - coef * d (or -d
alone with use_task_rewards=false) on their shards (rlsp.workers.stage_distill; the formula in
rlsp/algos/distillation.py). The student's logprobs are the behaviour policy's (`old_logprobs`: the actor's
forward, or the engine's with rollout logprobs). The driver routes rows to teachers by a per-row field and
receives per-row statistics only, from which it builds the distillation metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig
from transformers import AutoConfig, AutoTokenizer

from rlsp.algos.distillation import ROW_STATS, distillation_metrics_from_rows
from rlsp.config.run_spec import TeacherSpec, distillation_enabled, teacher_specs
from rlsp.data.batch import Batch
from rlsp.models.family_checks import check_sp_support, text_model_config
from rlsp.utils.timing import timed
from rlsp.workers.roles.teacher import route_rows
from rlsp.workers.stage_distill import DistillRequest

if TYPE_CHECKING:  # preflight (and rlsp.check) import this module without starting Ray
    from rlsp.controller.worker_group import RayWorkerGroup


def _vocab_problem(spec: TeacherSpec, student_tok: Any) -> str | None:
    """Why the teacher cannot score the student's token ids (None when it can)."""
    where = f"distillation.teacher_models.{spec.name}.model_path={spec.model_path!r}"
    try:
        teacher_tok = AutoTokenizer.from_pretrained(spec.model_path)
        config = text_model_config(AutoConfig.from_pretrained(spec.model_path))  # qwen3_5(_moe): its text model
    except (OSError, ValueError) as exc:
        return f"{where} cannot be loaded as a Hugging Face model with a tokenizer: {str(exc).splitlines()[0]}"
    try:  # the teacher runs the student's packed forward: a family rlsp trains (a multimodal wrapper is refused)
        check_sp_support(config, 1)
    except ValueError as exc:
        return f"{where}: {exc}"
    vocab_size = int(config.vocab_size)
    student, teacher = student_tok.get_vocab(), teacher_tok.get_vocab()
    if student != teacher:
        differ = sorted(set(student.items()) ^ set(teacher.items()), key=lambda kv: kv[1])[:3]
        return (f"{where}: the teacher's tokenizer differs from the student's ({len(teacher)} vs {len(student)} "
                f"tokens; e.g. {differ}); the teacher scores the student's token ids, so both need one vocabulary")
    if vocab_size < len(student):
        return f"{where}: the teacher's model has vocab_size={vocab_size} < the tokenizer's {len(student)} tokens"
    return None


def teacher_vocab_problems(cfg: DictConfig, student_tokenizer: Any | None = None) -> list[str]:
    """One message per teacher that cannot score the student's token ids (none with distillation off); run
    by preflight (so `rlsp.check` reports them) and again when the trainer starts."""
    if not distillation_enabled(cfg):
        return []
    tok = student_tokenizer or AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    return [p for spec in teacher_specs(cfg) if (p := _vocab_problem(spec, tok)) is not None]


def _route_problems(specs: Sequence[TeacherSpec], key: str, datasets: Iterable[Any]) -> list[str]:
    sources = sorted({str(item[key]) for ds in datasets if ds is not None for item in ds.items})
    try:
        route_rows(sources, specs)
    except ValueError as exc:
        return [f"distillation.teacher_key={key}: data {exc}"]
    return []


class Distillation:
    """The distillation step of one run (built once, before the workers start)."""

    def __init__(self, cfg: DictConfig, specs: Sequence[TeacherSpec]) -> None:
        self.cfg, self.specs = cfg, list(specs)
        self.request = DistillRequest.from_config(cfg.distillation.distillation_loss)
        self.key = str(cfg.distillation.teacher_key)

    @classmethod
    def build(cls, cfg: DictConfig, student_tokenizer: Any, datasets: Iterable[Any]) -> Distillation | None:
        """None with distillation off; else checks every teacher's vocabulary and that every row of the data
        routes to a teacher (one ValueError naming every problem)."""
        if not distillation_enabled(cfg):
            return None
        specs = teacher_specs(cfg)
        problems = teacher_vocab_problems(cfg, student_tokenizer) + _route_problems(specs, str(cfg.distillation.teacher_key), datasets)
        if problems:
            raise ValueError("invalid distillation setup:\n  - " + "\n  - ".join(problems))
        return cls(cfg, specs)

    def teacher_logprobs(self, wg: RayWorkerGroup, batch: Batch) -> None:
        """`teacher_logprobs` into `batch`, each row from its routed teacher."""
        routes = route_rows(batch.meta[self.key], self.specs)
        names = [s.name for s in self.specs if s.name in set(routes)]
        batch.update(wg.call("teacher", "compute_teacher_log_prob", batch, names))

    def apply(self, wg: RayWorkerGroup, batch: Batch, timing: dict[str, float]) -> dict[str, float]:
        """Teacher logprobs, then advantages = A_task - coef * d (or -d) on the workers; returns the distillation
        metrics, from the per-row values the workers report. The caller has read the rows' teacher keys (`key`)."""
        with timed("timing/teacher_s", timing):
            self.teacher_logprobs(wg, batch)
        return self.add_term(wg, batch)

    def add_term(self, wg: RayWorkerGroup, batch: Batch) -> dict[str, float]:
        """advantages = A_task - coef * d (or -d) on the workers that hold the rows' teacher logprobs (the
        advantages stay there); the distillation metrics from the per-row values they report."""
        batch.update(wg.call("teacher", "apply_distillation", batch, self.request))
        return distillation_metrics_from_rows({key: batch[key] for key in ROW_STATS})
