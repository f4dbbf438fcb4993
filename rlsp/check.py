"""`python -m rlsp.check [--config-name NAME] key=value ...`: every start-up check of the run that
`python -m rlsp.main` with the same arguments would start, without starting it.

No Ray, no workers, no accelerator. The config is composed as rlsp.main composes it
(`rlsp.config.compose`) and validated for the cluster the command asks for (trainer.nnodes x
trainer.n_gpus_per_node, whatever this machine has); the model's config.json and tokenizer are read
(never its weights; `builtin://` assets resolve as preflight resolves them); the data files' columns,
data sources and prompt lengths (image tokens included) are counted (prompts over data.max_prompt_length per
data.filter_overlong_prompts / data.truncation); the trackers' packages are looked up; and the resume
checks run (once the run length is known). These are the registered start-up checks (rlsp.config.checks),
stage by stage, the same list `python -m rlsp.main` runs before any worker has the run's config. It prints the layout, the batch split and
token budgets, the schedule, and what rlsp does with each verl key of the command, then every
problem found. Under "layers" it says, per decoder-layer kind of the model, how the actor's Ulysses /
ring / tp degrees split its heads and which attention kernel and MLP run it (rlsp.config.layer_report).
Exit 0 when there is none, 2 listing all of them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlsp.config.auto import AutoChoice, model_shape
from rlsp.config.compose import DEFAULT_CONFIG, CommandLine, compose_collecting, drop_not_set, parse_command_line
from rlsp.config.describe import describe_batches, describe_placement, describe_schedule
from rlsp.config.layout import ParallelLayout
from rlsp.config.run_length import run_length_errors
from rlsp.config.validate import validate_config
from rlsp.config.verl_compat import verl_key_notes
from rlsp.config.verl_spellings import rename_overrides
from rlsp.data.image_count import train_image_tokens
from rlsp.data.multimodal import image_tokens_line, new_image_problems
from rlsp.utils.fast_exit import run_and_exit

SHOWN_ROW_PROBLEMS = 5  # per data split: the first few unreadable rows, then a count


@dataclass
class Report:
    """What the checks found: description lines (per section), notes and problems."""

    sections: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def add(self, section: str, *lines: str) -> None:
        self.sections.setdefault(section, []).extend(lines)

    def render(self) -> str:
        out = []
        for name, lines in self.sections.items():
            out += [f"{name}:", *(f"  {line}" for line in lines)]
        if self.problems:
            out += [f"{len(self.problems)} problem(s):", *(f"  - {p}" for p in self.problems)]
        else:
            out.append("OK: no problems found")
        return "\n".join(out)


def _validate(cfg: DictConfig, report: Report) -> ParallelLayout | None:
    """The config stage (setting the `auto` keys, building the layout), as rlsp.main runs it."""
    auto: list[AutoChoice] = []
    try:
        return validate_config(cfg, auto, train_image_tokens(cfg))  # image tokens: the auto rules' data
    except ValueError as exc:
        report.problems += [line[4:] for line in str(exc).splitlines() if line.startswith("  - ")]
        return None
    finally:
        if auto:
            report.add("auto settings (what rlsp chose where the command left auto)", *(c.line() for c in auto))


def _model(cfg: DictConfig, layout: ParallelLayout | None, report: Report) -> Any:
    """The model's architecture line, its layers and its tokenizer (None when there is none to read)."""
    from rlsp.checks.resume_check import arch, describe  # noqa: PLC0415
    from rlsp.config.layer_report import layer_section  # noqa: PLC0415
    from rlsp.models.loading import read_model_config, tokenizer_problem  # noqa: PLC0415
    from rlsp.parallel.heads import plan_head_layout  # noqa: PLC0415

    key, path = "actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path
    try:
        config = read_model_config(key, path)
    except ValueError:
        return None  # preflight_errors names what is missing
    report.add("model", f"{path}: {describe(arch(config))}")
    if (shape := model_shape(path)[0]) is not None and shape.moe:  # total and active parameters (MoE)
        active = shape.active_decoder_params + shape.root_params
        report.add("model", f"parameters: {shape.params:,} total, {active:,} active per token")
    if layout is not None:  # per layer kind, what runs where at the actor's degrees
        report.add(*layer_section(config.to_dict(), layout.actor, plan_head_layout))
    if tokenizer_problem(key, path):
        return None  # likewise
    try:
        return _tokenizer(os.path.abspath(path), os.path.getmtime(path))
    except (OSError, ValueError) as exc:
        report.problems.append(f"actor_rollout_ref.model.path={path!r}: no readable tokenizer ({exc})")
        return None


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str, mtime: float) -> Any:
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(path)


@functools.lru_cache(maxsize=16)
def _prompt_report(files: tuple[tuple[str, float], ...], tokenizer: Any, prompt_key: str, chat_template: bool,
                   agent: Any = None, template_kwargs: str = "{}") -> Any:
    """Prompt lengths of `files` (paths with their mtimes), cached: repeated checks in one process (a
    notebook, the test of verl's commands) tokenize each dataset once (`template_kwargs`: as JSON, hashable)."""
    from rlsp.data.dataset import prompt_report  # noqa: PLC0415

    return prompt_report([f for f, _ in files], tokenizer, prompt_key, chat_template, agent, json.loads(template_kwargs))


def _split(cfg: DictConfig, name: str, files: list[str], tokenizer: Any, report: Report,
           agent: Any = None) -> int | None:
    """Report one data split; returns how many prompts training would keep (None: unknown)."""
    d, key = cfg.data, f"data.{name}_files"
    stamped = tuple((os.path.abspath(f), os.path.getmtime(f)) for f in files)
    from rlsp.data.dataset import chat_template_kwargs  # noqa: PLC0415

    kwargs = json.dumps(chat_template_kwargs(cfg), sort_keys=True)
    found = _prompt_report(stamped, tokenizer, d.prompt_key, bool(d.apply_chat_template), agent, kwargs)
    if agent is not None:
        _agent_section(cfg, name, found.agent_loops, tokenizer, report)
    problems = new_image_problems(found.problems, report.problems)  # a model's image refusal: said once
    report.problems += problems[:SHOWN_ROW_PROBLEMS]
    if len(problems) > SHOWN_ROW_PROBLEMS:
        report.problems.append(f"{key}: {len(problems) - SHOWN_ROW_PROBLEMS} more unreadable rows or files")
    limit, over = d.max_prompt_length, found.overlong(d.max_prompt_length)
    longest = max(found.lengths, default=0)
    line = f"{name}: {len(files)} file(s), {found.rows} rows, prompts up to {longest} tokens"
    kept = len(found.lengths)
    if over and d.filter_overlong_prompts:
        kept -= over
        line += f"; {over} longer than {limit} dropped (data.filter_overlong_prompts=true)"
    elif over and d.truncation == "error":
        report.problems.append(f"{key}: {over} prompts are longer than data.max_prompt_length={limit} (up to {longest} "
                               "tokens) and data.truncation=error; raise max_prompt_length, set "
                               "data.filter_overlong_prompts=true or data.truncation=left|right|middle")
    elif over:
        line += f"; {over} longer than {limit} cut (data.truncation={d.truncation})"
    report.add("data", line + (f"; no {', '.join(found.missing_columns)} column" if found.missing_columns else ""))
    report.add("data", *image_tokens_line(name, found.image_tokens))
    _check_sources(cfg, key, found.sources, report)
    if found.rows and kept == 0:
        report.problems.append(f"{key}: none of the {found.rows} prompts fits data.max_prompt_length={limit}")
    return kept if not found.problems else None


def _check_sources(cfg: DictConfig, key: str, sources: set[str], report: Report) -> None:
    """Every data_source needs a rule reward unless a custom function (or a reward model) scores it."""
    from rlsp.rewards.registry import known_sources  # noqa: PLC0415

    if cfg.reward.custom_function_path or OmegaConf.select(cfg, "reward_model.enable", default=False):
        return
    unscored = sorted(sources - set(known_sources()))
    if unscored:
        report.problems.append(f"{key}: data_source {unscored} has no rule reward (known: {known_sources()}); set "
                               "reward.custom_function_path (verl: custom_reward_function.path)")


def _agent_rows(cfg: DictConfig) -> Any:
    """How rows render for agent loops (None: no agent loops, or tools that preflight reports as broken)."""
    from rlsp.agent.rows import agent_rows  # noqa: PLC0415

    try:
        return agent_rows(cfg)
    except (ValueError, RuntimeError, TypeError):
        return None


def _agent_section(cfg: DictConfig, split: str, loops: dict[str, int], tokenizer: Any, report: Report) -> None:
    from rlsp.agent.rows import unknown_agent_loops  # noqa: PLC0415
    from rlsp.checks.preflight_agent import describe_agent  # noqa: PLC0415

    report.problems += unknown_agent_loops(loops, f"data.{split}_files column agent_name")
    if split == "train":
        report.add("agent", *describe_agent(cfg, loops, tokenizer))


def _data(cfg: DictConfig, tokenizer: Any, report: Report) -> int | None:
    """Both splits; returns the training prompts and writes the run length into cfg (verl's rule)."""
    if tokenizer is None:
        report.add("data", "not read: no tokenizer to count prompt tokens with")
        return None
    agent = _agent_rows(cfg)
    train = [f for f in cfg.data.train_files if os.path.isfile(f)]
    kept = _split(cfg, "train", train, tokenizer, report, agent) if train else None
    val = [f for f in cfg.data.val_files or [] if os.path.isfile(f)]
    if val:
        _split(cfg, "val", val, tokenizer, report, agent)
    if kept is None:
        return None
    errors = run_length_errors(cfg, kept)
    report.problems += errors
    if not errors:
        from rlsp.config.run_length import resolve_total_steps  # noqa: PLC0415

        resolve_total_steps(cfg, kept)
    return kept


def _files(cfg: DictConfig, layout: ParallelLayout | None, report: Report) -> Any:
    """Assets, preflight's checks and the model; returns the tokenizer (or None)."""
    from rlsp.checks.preflight import preflight_errors, resolve_assets  # noqa: PLC0415
    from rlsp.utils.device import target_device_type  # noqa: PLC0415

    try:
        resolve_assets(cfg)
    except (ValueError, OSError) as exc:
        report.problems.append(str(exc))
        return None
    try:
        device = target_device_type(cfg.trainer.device)  # the run's device, not necessarily this machine's
    except ValueError:  # an illegal trainer.device: validation has listed it; check the rest as on cpu
        device = "cpu"
    report.add("cluster", f"device: {device} (trainer.device={cfg.trainer.device}; nothing is opened here)")
    skipped: dict[str, str] = {}
    report.problems += preflight_errors(cfg, layout, device, skipped)  # the preflight stage, as rlsp.main runs it
    if blocked := [f"{name} ({why})" for name, why in skipped.items() if why != "not in use"]:
        report.add("checks", f"not checked until the problems below are fixed: {', '.join(blocked)}")
    return _model(cfg, layout, report)


def _resume(cfg: DictConfig, layout: ParallelLayout | None, report: Report) -> None:
    """The resume stage, as rlsp.main runs it (skipped only where the run length is still unknown)."""
    from rlsp.checks.resume_check import describe_resume  # noqa: PLC0415

    try:
        report.add("resume", describe_resume(cfg, layout))
    except ValueError as exc:
        report.problems.append(str(exc))


def _verl_keys(line: CommandLine, report: Report) -> None:
    """What rlsp does with each verl key of the command that it handles its own way."""
    if notes := verl_key_notes(line.overrides):
        report.add("verl keys", *notes)
    _, left_out = drop_not_set(rename_overrides(line.overrides)[0])
    if left_out:
        report.add("verl keys", *left_out)


def run_checks(argv: list[str]) -> Report:
    """Every check of `argv` (rlsp.main's arguments), collected into one report."""
    report = Report()
    try:
        line = parse_command_line(argv)
    except ValueError as exc:
        report.problems.append(str(exc))
        return report
    cfg, report.problems = compose_collecting(line)
    if cfg is None:
        return report
    report.add("config", f"configs/{line.config_name}.yaml + {len(line.overrides)} override(s)")
    if line.config_name == DEFAULT_CONFIG and not str(cfg.actor_rollout_ref.model.path).startswith("builtin://"):
        report.add("config", f"note: configs/{DEFAULT_CONFIG}.yaml is the tiny CPU demo's (its learning rate, KL and "
                             "entropy coefficients and run length suit the built-in model); start a real model from "
                             "--config-name grpo, a verl command line from --config-name verl")
    explicit_steps = cfg.trainer.total_training_steps is not None
    layout = _validate(cfg, report)
    tokenizer = _files(cfg, layout, report)
    num_prompts = _data(cfg, tokenizer, report)
    if layout is not None:  # a valid config: its numbers can be described
        report.add("cluster", *describe_placement(cfg, layout))
        report.add("batches", *describe_batches(cfg, layout))
        report.add("schedule", *describe_schedule(cfg, num_prompts, explicit_steps, layout.has_critic))
    _resume(cfg, layout, report)
    _verl_keys(line, report)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    report = run_checks(argv)
    print(report.render())
    return 2 if report.problems else 0


if __name__ == "__main__":
    run_and_exit(lambda: sys.exit(main()))  # no interpreter teardown (~1.5 s with torch loaded)
