"""De-quantize a GGUF checkpoint once into an fp32 Hugging Face directory that trainer and vLLM load.

transformers reads GGUF (`from_pretrained(dir, gguf_file=name)`, needs the `gguf` package) and
de-quantizes every tensor to fp32, but it refuses to `save_pretrained` such a model. So the
directory is written piece by piece:
- `model.safetensors`: the state dict, without `lm_head.weight` when the embeddings are tied (the
  loader re-ties it; a second copy would be a second, diverging parameter for vLLM);
- `config.json`: without `quantization_config` (it would make every loader look for the GGUF file
  again), with `architectures` set and dtype float32; head_dim, rope parameters and
  tie_word_embeddings come through from the GGUF metadata;
- `generation_config.json` (eos/pad ids stop generation at the end of the assistant turn) and the
  tokenizer files (chat template when the GGUF has one, eos/pad tokens, and the GGUF's add_bos/add_eos
  flags, which transformers' GGUF tokenizer drops);
- `rlsp_gguf_source.json`: where it came from (file name, sha256).

The output lives at `<cache_dir>/models/gguf-<sha256 prefix of the file>/`, keyed by the file's
content, written to a temporary directory next to it and renamed into place, so concurrent runs
never see a half-written model and a changed file never reuses a stale conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import torch

from rlsp.utils.logging import get_logger

log = get_logger("rlsp.models.gguf")
SOURCE_FILE = "rlsp_gguf_source.json"
HASH_PREFIX_LEN = 16
_HASH_CHUNK = 1 << 22
_TOKENIZER_FLAGS = ("add_bos_token", "add_eos_token")


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def find_gguf(path: str) -> str | None:
    """The GGUF file `path` names: the file itself, or the single `.gguf` in a directory.

    Returns None for a directory without any GGUF file (a plain HF directory); raises ValueError
    for a directory holding several, naming them.
    """
    if os.path.isfile(path):
        return os.path.abspath(path) if path.endswith(".gguf") else None
    if not os.path.isdir(path):
        return None
    found = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(
            f"{path} holds {len(found)} GGUF files {found}; give the path of one of them "
            "(actor_rollout_ref.model.path=<dir>/<file>.gguf)"
        )
    return os.path.abspath(os.path.join(path, found[0])) if found else None


def gguf_output_dir(gguf_path: str, cache_dir: str, sha256: str | None = None) -> str:
    sha256 = sha256 or file_sha256(gguf_path)
    return os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), "models", f"gguf-{sha256[:HASH_PREFIX_LEN]}")


def converted_sha(out_dir: str) -> str | None:
    try:
        with open(os.path.join(out_dir, SOURCE_FILE)) as f:
            return json.load(f).get("sha256")
    except (OSError, ValueError):
        return None


def _state_dict_to_save(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    state = {name: t.detach().to(torch.float32).contiguous() for name, t in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    return state


def _fix_config_json(out_dir: str, architecture: str) -> None:
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    config["architectures"] = [architecture]
    config["dtype"] = "float32"
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def _make_readable(out_dir: str) -> None:
    # mkdtemp and safetensors create owner-only entries; other users of a shared cache must read them.
    os.chmod(out_dir, 0o755)
    for name in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, name), 0o644)


def gguf_tokenizer_flags(gguf_path: str) -> dict[str, bool]:
    """The GGUF's `tokenizer.ggml.add_bos_token` / `add_eos_token` flags (those present in its metadata)."""
    from gguf import GGUFReader  # noqa: PLC0415

    fields = GGUFReader(gguf_path).fields
    return {key: bool(fields[f"tokenizer.ggml.{key}"].contents())
            for key in _TOKENIZER_FLAGS if f"tokenizer.ggml.{key}" in fields}


def _load_tokenizer(src_dir: str, name: str) -> Any:
    # transformers' GGUF tokenizer ignores the add_bos/add_eos flags: Gemma 3's GGUF asks for <bos> (without
    # it the model continues text incoherently), and the loaded tokenizer would not add it.
    from transformers import AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    for key, value in gguf_tokenizer_flags(os.path.join(src_dir, name)).items():
        if getattr(tokenizer, key, value) != value:
            setattr(tokenizer, key, value)
    return tokenizer


def _write_hf_dir(gguf_path: str, out_dir: str, sha256: str) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    src_dir, name = os.path.split(gguf_path)
    tokenizer = _load_tokenizer(src_dir, name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    save_file(_state_dict_to_save(model, tied), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    _fix_config_json(out_dir, type(model).__name__)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, SOURCE_FILE), "w") as f:
        json.dump({"gguf_file": name, "sha256": sha256}, f, indent=2)


def convert_gguf(gguf_path: str, cache_dir: str, sha256: str | None = None) -> str:
    """Return the HF directory converted from `gguf_path`, converting only when it is missing.
    `sha256`: the file's digest when the caller has just computed it (else it is computed here)."""
    if not os.path.isfile(gguf_path):
        raise ValueError(f"GGUF file not found: {gguf_path}")
    sha256 = sha256 or file_sha256(gguf_path)
    out_dir = gguf_output_dir(gguf_path, cache_dir, sha256)
    if converted_sha(out_dir) == sha256:
        return out_dir
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".gguf-convert-", dir=parent)
    log.info("de-quantizing %s into an fp32 HF directory %s (once per file)", gguf_path, out_dir)
    try:
        _write_hf_dir(gguf_path, staging, sha256)
        _make_readable(staging)
        if converted_sha(out_dir) == sha256:  # another process finished first: keep its copy
            shutil.rmtree(staging)
            return out_dir
        if os.path.exists(out_dir):  # an interrupted or foreign directory under our key
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if converted_sha(out_dir) == sha256:
            return out_dir  # lost a rename race against an identical conversion
        raise
    return out_dir


def ensure_hf_checkpoint(path: str, cache_dir: str) -> str:
    """`path` itself for an HF directory (it has a config.json); the converted directory for a GGUF
    file or a directory holding one; `path` unchanged otherwise (the caller reports what is missing)."""
    path = os.path.expanduser(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return path
    gguf = find_gguf(path)
    return convert_gguf(gguf, cache_dir) if gguf else path
