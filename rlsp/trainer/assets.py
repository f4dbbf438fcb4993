"""Resolve `builtin://` paths of the default config into files built locally under trainer.cache_dir.

`builtin://tiny-qwen2` is a deterministic random-init Qwen2 + char tokenizer; `builtin://arithmetic/
{train,test}` is the synthetic arithmetic task. Anything else is returned as given (a local path).
"""

from __future__ import annotations

import os

from rlsp.data.tasks.arithmetic import write_arithmetic_parquet
from rlsp.models.tiny import TinyModelSpec, ensure_tiny_model

PREFIX = "builtin://"


def _cache(cache_dir: str, *parts: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), *parts)


def resolve_model_path(path: str, cache_dir: str) -> str:
    if not path.startswith(PREFIX):
        return path
    name = path[len(PREFIX):]
    if name != "tiny-qwen2":
        raise ValueError(f"unknown built-in model {path!r}; legal: '{PREFIX}tiny-qwen2' or a local path")
    return ensure_tiny_model(_cache(cache_dir, "models", "tiny-qwen2"), TinyModelSpec())


def resolve_data_files(files: str | list[str] | None, cache_dir: str) -> list[str]:
    if files is None:
        return []
    out = []
    for f in [files] if isinstance(files, str) else list(files):
        if not f.startswith(PREFIX):
            out.append(f)
            continue
        name = f[len(PREFIX):]
        legal = (f"{PREFIX}arithmetic/train", f"{PREFIX}arithmetic/test")
        if f not in legal:
            raise ValueError(f"unknown built-in dataset {name!r}; legal: {list(legal)} or parquet paths")
        data_dir = _cache(cache_dir, "data", "arithmetic")
        # Regenerated every run (milliseconds, atomic rename): a cache never outlives a change of the task.
        train, test = write_arithmetic_parquet(data_dir)
        out.append(train if name.endswith("train") else test)
    return out
