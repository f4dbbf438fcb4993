"""verl's key surface: the release rlsp tracks, and one answer per key of it.

`verl_0_9_keys.json` (written by scripts/extract_verl_keys.py) lists every key of verl 0.9's PPO trainer config
(FSDP engine) with verl's default. Every key gets exactly one answer, computed from rlsp's own tables:

* "same": the schema declares it (or verl's other spelling of a declared key: rlsp.config.verl_compat ALIASES,
  rlsp.config.verl_spellings) with verl's meaning;
* "rlsp": accepted, rlsp reaches verl's result its own way (verl_compat.VERL_NOTES on a declared key, or
  `ACCEPTED_VALUES`, rlsp.config.verl_0_9_tables: an undeclared key whose listed values are what rlsp does anyway);
* "refused": refused by name with the reason (verl_compat UNSUPPORTED_KEYS, NOT_YET_KEYS).

"Not set" is always accepted: a refused key set to null, or to verl's own default where that default means off
(false, 0, an empty value, "disabled"), changes nothing in verl either; such an override is dropped with a note
(`not_set_overrides`), so verl command lines that spell out verl's defaults run.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
from pathlib import Path
from typing import Any

from rlsp.config.verl_0_9_tables import ACCEPTED_VALUES

VERL_RELEASE = "v0.9.0"
KEYS_FILE = Path(__file__).resolve().parent / "verl_0_9_keys.json"
_OFF = (None, False, 0, 0.0, "", [], {}, "disabled")

@functools.lru_cache(maxsize=1)
def verl_keys() -> dict[str, Any]:
    """verl 0.9's keys -> verl's defaults (verl_0_9_keys.json)."""
    return json.loads(KEYS_FILE.read_text())["keys"]


def _match(key: str, table: dict[str, Any]) -> Any:
    for pattern, value in table.items():
        if fnmatch.fnmatchcase(key, pattern):
            return value
    return None


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b or (isinstance(a, int | float) and isinstance(b, int | float)
                                             and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def not_set(key: str, value: Any, verl_key: str | None = None) -> bool:
    """Whether `value` is verl's "not set" for `key`: null, or verl 0.9's default of the key (`verl_key`: the key as
    the command spelled it) where that default means off."""
    if value is None:
        return True
    default = verl_keys().get(verl_key or key, verl_keys().get(key, object()))
    return any(_same(default, off) for off in _OFF) and _same(value, default)


def accepted_value(key: str, value: Any) -> str | None:
    """What rlsp does for undeclared `key` set to `value` when that is one of ACCEPTED_VALUES, else None."""
    entry = _match(key, ACCEPTED_VALUES)
    if entry is not None and any(_same(value, v) for v in entry[0]):
        return entry[1]
    return None


def not_set_overrides(overrides: list[str], declared: set[str], refused: Any) -> tuple[list[str], list[str]]:
    """(`overrides` without those that set an undeclared, refused verl key (`refused(key)` is its reason) to verl's
    "not set" or to a value rlsp's behaviour already is, one note per override left out)."""
    # hydra here, not at import: the workers and the GPU checks import rlsp.config without hydra installed
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    kept, notes = [], []
    for text in overrides:
        try:
            (parsed,) = parser.parse_overrides([text])
            key, value = parsed.key_or_group, parsed.value()
        except (HydraException, ValueError):
            kept.append(text)
            continue
        if key in declared or parsed.is_delete() or not refused(key):
            kept.append(text)
        elif not_set(key, value):
            notes.append(f"{key}={text.partition('=')[2]}: verl's \"not set\" for a feature rlsp does not have "
                         "(accepted, nothing to do)")
        elif (note := accepted_value(key, value)) is not None:
            notes.append(f"{key}={text.partition('=')[2]}: {note} (accepted)")
        else:
            kept.append(text)
    return kept, notes


def answer(key: str, declared: set[str]) -> tuple[str, str]:
    """("same" | "rlsp" | "refused" | "unknown", what rlsp does) for verl key `key` (`declared`: the schema's keys)."""
    from rlsp.config.verl_compat import ALIASES, VERL_NOTES, unsupported_reason  # noqa: PLC0415
    from rlsp.config.verl_spellings import rlsp_key  # noqa: PLC0415

    target = ALIASES.get(key, rlsp_key(key))
    if target in declared or _declared_entry(target, declared):
        note = _note(target, VERL_NOTES) if target != key else _note(key, VERL_NOTES)
        if note:
            return "rlsp", note
        return "same", ("same key, same meaning" if target == key else f"verl's spelling of `{target}`")
    if (entry := _match(target, ACCEPTED_VALUES)) is not None:
        return "rlsp", f"{', '.join(map(str, entry[0]))}: {entry[1]}; other values refused"
    reason = unsupported_reason(target)
    return ("refused", reason) if reason else ("unknown", "not declared and not refused by name")


def _declared_entry(key: str, declared: set[str]) -> bool:
    """A key under a schema mapping whose entries the user names (distillation.teacher_models.<name>.*)."""
    from rlsp.config.schema_distill import TeacherModelConfig  # noqa: PLC0415

    prefix = "distillation.teacher_models."
    entry = key[len(prefix):].partition(".")[2]
    return key.startswith(prefix) and entry in _flat(dataclasses.asdict(TeacherModelConfig()))


def _flat(node: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for k, v in node.items():
        out.add(f"{prefix}{k}")
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
    return out


def _note(key: str, notes: dict[str, str]) -> str | None:
    for pattern, text in notes.items():
        if fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(f"{key}.*", pattern):
            return text
    return None
