"""Regenerate docs/config.md from the schema: `python scripts/gen_config_doc.py [--check]`."""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

from rlsp.config.schema import RLSPConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"
HEADER = """# Configuration

Every key below can be overridden on the command line (`python -m rlsp.main key=value ...`). Names
follow verl where a verl user would expect them. The schema is `rlsp/config/schema.py` (this page is
generated from it by `scripts/gen_config_doc.py`); `configs/grpo.yaml` uses them as they are, and
`configs/rlsp.yaml` (the default config) overrides a few for
the tiny CPU demo. Values are checked at start-up (`rlsp/config/validate.py`,
`rlsp/trainer/preflight.py`) before any worker starts.

Batch-size semantics (as in verl): `data.train_batch_size` and `actor_rollout_ref.actor.ppo_mini_batch_size`
count *prompts*; each yields `rollout.n` samples. `*_micro_batch_size_per_gpu` counts *samples* per
worker per forward. Generation splits prompts over all workers; training splits samples over the
dp = workers / sp groups, and every rank of an sp group gets the same rows.

`builtin://tiny-qwen2` and `builtin://arithmetic/{train,test}` are built locally under
`trainer.cache_dir` on first use; any other value is a local path.

| key | default | notes |
|---|---|---|
"""


def _comments(cls: type) -> dict[str, str]:
    """Trailing comments of the field lines of `cls` and its dataclass bases (the class's own win)."""
    found: dict[str, str] = {}
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        for m in re.finditer(r"^\s+(\w+): [^=\n]+= [^\n#]*?(?:#\s*(.*))?$", inspect.getsource(klass), re.M):
            if m.group(2):
                found.setdefault(m.group(1), m.group(2).replace("|", "\\|"))
    return found


def _rows(cls: type, prefix: str) -> list[str]:
    rows = []
    notes = _comments(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            rows += _rows(type(default), f"{prefix}{f.name}.")
        else:
            rows.append(f"| `{prefix}{f.name}` | `{default!r}` | {notes.get(f.name, '')} |")
    return rows


def render() -> str:
    return HEADER + "\n".join(_rows(RLSPConfig, "")) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if DOC.read_text() == text else "docs/config.md is stale: run python scripts/gen_config_doc.py")
    DOC.write_text(text)
