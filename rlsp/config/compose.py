"""Compose a run's config from configs/*.yaml and command-line overrides, as `python -m rlsp.main` does.

`rlsp.main` composes through `@hydra.main(config_path=CONFIG_DIR, config_name=DEFAULT_CONFIG)`;
`rlsp.check` through `compose_config`: Hydra's compose API over the same directory, config name and
overrides, without creating a run dir or its .hydra/ output. Both then run `validate_config`, whose
first step maps verl's spellings onto rlsp's keys (rlsp.config.verl_compat).

Before that, verl's other spellings of a key (a newer or older verl release's name for a setting rlsp declares
once, rlsp.config.verl_spellings) are rewritten onto rlsp's key, and a `+key=value` for a key the schema
declares loses its `+` (verl commands add keys verl's schema lacks). `override_problems` then screens the
overrides: verl keys rlsp refuses are named with the reason
(Hydra alone would only say the key is not in the schema), misspelt keys with the nearest legal ones.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig

from rlsp.config.schema_policy_loss import rewrite_policy_loss_override
from rlsp.config.store import register_schema
from rlsp.config.validate_keys import schema_keys, unknown_key_error
from rlsp.config.verl_compat import OPEN_MAPPINGS, refusal
from rlsp.config.verl_keys import not_set_overrides
from rlsp.config.verl_spellings import rename_overrides, rlsp_key

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")
DEFAULT_CONFIG = "rlsp"
CONFIG_NAME_FLAGS = ("--config-name", "-cn")
USAGE = "arguments: [--config-name NAME] key=value ... (the same as python -m rlsp.main)"


@dataclass
class CommandLine:
    """A `python -m rlsp.main` command line: the config's name and the key=value overrides."""

    config_name: str = DEFAULT_CONFIG
    overrides: list[str] = field(default_factory=list)


def parse_command_line(argv: list[str]) -> CommandLine:
    """The config name (`--config-name X`, `--config-name=X`, `-cn X`) and overrides of `argv`."""
    line, rest = CommandLine(), list(argv)
    while rest:
        arg = rest.pop(0)
        flag, _, value = arg.partition("=")
        if flag in CONFIG_NAME_FLAGS:
            if not value and not rest:
                raise ValueError(f"{flag} needs a config name ({USAGE})")
            line.config_name = value or rest.pop(0)
        elif arg.startswith("-"):
            raise ValueError(f"unknown option {arg!r}; {USAGE}")
        else:
            line.overrides.append(rewrite_policy_loss_override(arg))  # old policy-loss spellings -> nested
    return line


def without_redundant_add(overrides: list[str]) -> list[str]:
    """verl commands add keys its own schema lacks with `+key=value` (e.g. +reward.reward_kwargs.max_resp_len); where
    rlsp's schema declares the key Hydra would refuse the `+` ("an item is already at ..."): it becomes `key=value`."""
    declared = set(schema_keys())
    return [t[1:] if t.startswith("+") and not t.startswith("++") and t[1:].partition("=")[0] in declared else t
            for t in overrides]


def open_mapping(key: str) -> bool:
    """Whether `key` is an entry of a schema mapping whose entries the user names (its parent is declared as an
    open dict, e.g. actor_rollout_ref.rollout.engine_kwargs.vllm)."""
    parent = key.rpartition(".")[0]
    return parent in OPEN_MAPPINGS or any(parent.startswith(f"{m}.") for m in OPEN_MAPPINGS)


def override_problems(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides that can be composed, one message per override that cannot: a syntax error, a verl
    key rlsp refuses (with the reason) or a key the schema does not declare (with the nearest ones))."""
    legal, keep, problems = schema_keys(), [], []
    declared = set(legal)
    parser = OverridesParser.create()
    for text in overrides:
        try:
            (parsed,) = parser.parse_overrides([text])
        except HydraException as exc:
            problems.append(f"cannot parse override {text!r}: {str(exc).splitlines()[0]}")
            continue
        key = parsed.key_or_group
        if key.startswith("hydra") or "/" in key or key in declared:
            keep.append(text)
        elif open_mapping(key):  # a new entry: Hydra needs the `+` that verl's commands may leave out
            keep.append(text if parsed.is_add() or parsed.is_force_add() or parsed.is_delete() else f"+{text}")
        elif (parsed.is_add() or parsed.is_force_add()) and not refusal(key):
            keep.append(text)  # Hydra adds it; validate_config names it as an unknown key
        else:
            problems.append(unknown_key_error(key, legal, text))
    return keep, problems


def verl_argv(argv: list[str]) -> list[str]:
    """rlsp.main's arguments with verl's other key spellings rewritten onto rlsp's keys and a redundant `+`
    dropped (as rlsp.check composes them); exits 2 naming a setting given twice with different values."""
    flags = [a for a in argv if a.startswith("-") or "=" not in a and not a.startswith("~")]
    renamed, problems = rename_overrides([a for a in argv if a not in flags])
    if problems:
        print("invalid rlsp config:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        raise SystemExit(2)
    renamed, notes = drop_not_set(renamed)
    if notes:
        print("verl keys of this command left out:\n  " + "\n  ".join(notes), file=sys.stderr)
    return flags + without_redundant_add(renamed)


def drop_not_set(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(`overrides` without the refused verl keys set to verl's "not set" (null, verl's off default) or to a value
    that is rlsp's behaviour already, one note per key left out): rlsp.config.verl_keys."""
    return not_set_overrides(overrides, set(schema_keys()), refusal)


def refused_overrides(overrides: list[str]) -> list[str]:
    """One message per override of an undeclared verl key that rlsp refuses, with the reason."""
    declared, out = set(schema_keys()), []
    for text in overrides:
        try:
            (parsed,) = OverridesParser.create().parse_overrides([text])
        except HydraException:
            continue  # Hydra reports it
        if parsed.key_or_group not in declared and refusal(parsed.key_or_group):
            out.append(refusal(parsed.key_or_group))
    return out


def compose_config(config_name: str = DEFAULT_CONFIG, overrides: list[str] | None = None) -> DictConfig:
    """configs/<config_name>.yaml with `overrides` applied, as rlsp.main composes it (not validated)."""
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=config_name, overrides=list(overrides or []))


def compose_collecting(line: CommandLine) -> tuple[DictConfig | None, list[str]]:
    """Compose `line`, leaving out every override that cannot be applied and naming each one, so all
    other checks can still run; None when even the config name fails."""
    renamed, problems = rename_overrides(line.overrides)
    renamed, _ = drop_not_set(renamed)
    keep, refused = override_problems(without_redundant_add(renamed))
    problems += [_as_written(p, line.overrides) for p in refused]
    try:
        return compose_config(line.config_name, keep), problems
    except HydraException as exc:
        if not keep:
            return None, [*problems, f"--config-name {line.config_name}: {_first_line(exc)}"]
    good = []
    for text in keep:  # find the overrides Hydra refuses (a wrong type, a bad value) one by one
        try:
            compose_config(line.config_name, [text])
            good.append(text)
        except HydraException as exc:
            problems.append(f"{text}: {_first_line(exc)}")
    try:
        return compose_config(line.config_name, good), problems
    except HydraException as exc:
        return None, [*problems, f"{' '.join(good)}: {_first_line(exc)}"]


def _as_written(problem: str, overrides: list[str]) -> str:
    """A refusal of rlsp's key that the command spelled verl's other way names the spelling written too."""
    for text in overrides:
        key = text.lstrip("+~").partition("=")[0]
        target = rlsp_key(key)
        if target != key and problem.startswith(f"{target} is not supported"):
            return f"{key} (verl's other spelling of {target}){problem[len(target):]}"
    return problem


def _first_line(exc: Exception) -> str:
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    cause = exc.__cause__
    detail = str(cause).splitlines()[0] if cause is not None and str(cause).strip() else ""
    return " ".join(lines[:1] + ([detail] if detail and detail not in lines[:1] else []))
