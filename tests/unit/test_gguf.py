"""GGUF -> HF conversion round trip on the packaged SmolLM2-135M-Instruct.

Reference: transformers' own GGUF load of the same file. The converted directory must give the
same logits (every position and vocabulary entry of a chat prompt), bit for bit: both are transformers'
fp32 forward of the same model class over the same de-quantized tensors, the same computation in the same
order; the same tokenizer (chat template, eos/pad/bos,
token ids) and the same config (head_dim, rope parameters, tied embeddings, head counts).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator

import pytest
import torch
from safetensors import safe_open
from timing import allowed
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlsp.models.fetch import packaged_gguf_path
from rlsp.models.gguf import SOURCE_FILE, convert_gguf, ensure_hf_checkpoint, file_sha256, find_gguf
from rlsp.run.assets import resolve_model_path

NAME = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Sam has 12 apples and buys 7 more. How many apples does Sam have now?"}]
CONFIG_KEYS = ("head_dim", "rope_parameters", "tie_word_embeddings", "num_attention_heads", "num_key_value_heads",
               "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "rms_norm_eps",
               "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act")


@pytest.fixture(scope="module")
def gguf_file() -> str:
    try:
        return packaged_gguf_path(NAME)
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("cache")
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)  # 0.5 GB of fp32 weights


@pytest.fixture(scope="module")
def converted(gguf_file: str, cache: str) -> str:
    t0 = time.perf_counter()
    path = convert_gguf(gguf_file, cache)
    print(f"\nGGUF -> HF conversion: {time.perf_counter() - t0:.1f}s")
    return path


@pytest.fixture(scope="module")
def reference(gguf_file: str) -> tuple:
    src, name = os.path.split(gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(src, gguf_file=name)


def test_logits_match_transformers_gguf_load(converted: str, reference: tuple) -> None:
    ref_model, ref_tok = reference
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = ref_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    input_ids = ids["input_ids"]
    assert input_ids.shape[1] > 20
    with torch.no_grad():
        want, got = ref_model(input_ids).logits, model(input_ids).logits
    diff = (want - got).abs().max().item()
    print(f"\nmax |logit diff| over {tuple(got.shape)}: {diff:.2e}")
    assert got.shape == want.shape and torch.equal(got, want), diff  # the same computation (module docstring)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def test_tokenizer_and_generation_config_survive(converted: str, reference: tuple) -> None:
    _, ref_tok = reference
    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.chat_template == ref_tok.chat_template and "<|im_start|>" in tok.chat_template
    assert (tok.eos_token, tok.eos_token_id) == (ref_tok.eos_token, ref_tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.pad_token_id == ref_tok.pad_token_id == 2 and tok.bos_token_id == ref_tok.bos_token_id
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == ref_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text, add_special_tokens=False) == ref_tok.encode(text, add_special_tokens=False)
    assert len(tok) == len(ref_tok) == 49152
    gen = GenerationConfig.from_pretrained(converted)
    assert gen.eos_token_id == 2 and gen.pad_token_id == 2


def test_config_fields_survive(converted: str, reference: tuple) -> None:
    ref_config = reference[0].config
    config = AutoConfig.from_pretrained(converted)
    for key in CONFIG_KEYS:
        assert getattr(config, key) == getattr(ref_config, key), key
    assert (config.head_dim, config.num_attention_heads, config.num_key_value_heads) == (64, 9, 3)
    assert config.rope_parameters["rope_theta"] == 100000.0 and config.tie_word_embeddings
    with open(os.path.join(converted, "config.json")) as f:
        raw = json.load(f)
    assert "quantization_config" not in raw and raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["dtype"] == "float32"
    with safe_open(os.path.join(converted, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
        assert f.get_tensor("model.norm.weight").dtype == torch.float32


def test_conversion_is_cached_and_paths_resolve(gguf_file: str, converted: str, cache: str, tmp_path) -> None:
    sha = file_sha256(gguf_file)
    assert os.path.basename(converted) == f"gguf-{sha[:16]}"
    assert os.path.dirname(converted) == os.path.join(cache, "models")
    with open(os.path.join(converted, SOURCE_FILE)) as f:
        assert json.load(f)["sha256"] == sha
    stamp = os.path.getmtime(os.path.join(converted, "model.safetensors"))
    t0 = time.perf_counter()
    assert convert_gguf(gguf_file, cache) == converted  # second call: no re-conversion
    elapsed = time.perf_counter() - t0
    assert os.path.getmtime(os.path.join(converted, "model.safetensors")) == stamp
    # the file's sha256 and a json read: well under a second on a quiet machine; 5 s there, scaled by how much
    # slower this one is now (a conversion takes far longer, and the unchanged mtime shows there was none)
    assert elapsed <= allowed(elapsed, 5), f"the cached call took {elapsed:.1f}s"
    assert resolve_model_path(gguf_file, cache) == converted  # a GGUF file
    assert resolve_model_path(os.path.dirname(gguf_file), cache) == converted  # a directory holding one
    assert resolve_model_path(f"builtin://{NAME}", cache) == converted
    assert ensure_hf_checkpoint(converted, cache) == converted  # an HF directory is used as is
    assert not [n for n in os.listdir(os.path.dirname(converted)) if n.startswith(".gguf-convert-")]


def test_find_gguf_rules(tmp_path) -> None:
    assert find_gguf(str(tmp_path)) is None
    (tmp_path / "a.gguf").write_bytes(b"")
    assert find_gguf(str(tmp_path)) == str(tmp_path / "a.gguf")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \['a.gguf', 'b.gguf'\]"):
        find_gguf(str(tmp_path))
    assert find_gguf(str(tmp_path / "b.gguf")) == str(tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="unknown built-in model 'builtin://nope'"):
        resolve_model_path("builtin://nope", str(tmp_path))
