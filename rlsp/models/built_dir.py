"""Model directories rlsp writes itself (the built-in tiny models): a spec's digest recorded beside the files, and an
atomic build -- written next to the target and renamed into place, so readers never see a half-written directory and
a directory built from the same spec by another process is kept."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any


def spec_digest(spec: Any, version: int) -> str:
    """Hash of a spec dataclass and its factory version; a mismatch triggers a rebuild."""
    payload = json.dumps({"spec": dataclasses.asdict(spec), "version": version}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def write_spec_file(out_dir: str, spec_file: str, spec: Any, digest: str) -> None:
    """Record `spec` and its digest in `out_dir/spec_file`."""
    with open(os.path.join(out_dir, spec_file), "w") as f:
        json.dump({"digest": digest, "spec": dataclasses.asdict(spec)}, f, indent=2)


def built_digest(out_dir: str, spec_file: str) -> str | None:
    """The digest recorded in `out_dir` (None when there is no readable spec file)."""
    try:
        with open(os.path.join(out_dir, spec_file)) as f:
            return json.load(f).get("digest")
    except (OSError, ValueError):
        return None


def build_atomically(out_dir: str, write: Callable[[str], None], digest: str, spec_file: str,
                     keep_matching: bool = True) -> str:
    """Run `write(staging)` in a directory next to `out_dir` (absolute) and rename it into place; with
    `keep_matching`, a directory another process installed meanwhile with the same `digest` is kept instead."""
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}-build-", dir=parent)
    try:
        write(staging)
        os.chmod(staging, 0o755)  # mkdtemp creates it owner-only
        if keep_matching and built_digest(out_dir, spec_file) == digest:  # someone may be reading it: keep it
            shutil.rmtree(staging)
            return out_dir
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if keep_matching and built_digest(out_dir, spec_file) == digest:
            return out_dir  # lost a rename race against an identical build
        raise
    return out_dir
