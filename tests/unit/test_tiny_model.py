"""Char tokenizer and tiny-model factory: round trips, chat template, save/load, determinism, rebuilds."""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlsp.models.tiny import SPEC_FILE, TinyModelSpec, build_tiny_model, ensure_tiny_model, main
from rlsp.models.tokenizer import ALPHABET, build_char_tokenizer, stop_token_ids

SPEC = TinyModelSpec()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(SPEC, str(tmp_path_factory.mktemp("tiny") / "model"))


def test_tokenizer_round_trip_one_token_per_char() -> None:
    tok = build_char_tokenizer()
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)
        assert tok.decode(ids) == text
    assert tok.decode(tok.encode("  a  \n\nb ", add_special_tokens=False)) == "  a  \n\nb "


def test_tokenizer_vocab_and_special_ids() -> None:
    tok = build_char_tokenizer()
    assert len(tok) == 58 < 64
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 3, 4)
    assert stop_token_ids(tok) == [3, 1]
    # Every alphabet character is a distinct single id after the five special tokens.
    assert [tok.encode(c, add_special_tokens=False) for c in ALPHABET] == [[5 + i] for i in range(len(ALPHABET))]


def test_chat_template_renders_qwen_style_prompt() -> None:
    tok = build_char_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 23 and ids[0] == 2 and ids[10] == 3 and ids[-1] == tok.encode("\n", add_special_tokens=False)[0]
    assert tok.decode(ids) == text
    assert tok.decode(ids + [3], skip_special_tokens=True) == "user\n3+4=\nassistant\n"


def test_saved_model_loads_with_spec_shapes(model_dir: str) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (128, 256, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.hidden_size // config.num_attention_heads == SPEC.head_dim == 32
    assert config.tie_word_embeddings and config.vocab_size == 58
    with open(os.path.join(model_dir, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [3, 1]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.float32
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    assert tuple(k_proj.shape) == (2 * 32, 128)  # GQA: 2 kv heads of 32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_saved_tokenizer_matches_built_one(model_dir: str) -> None:
    loaded, built = AutoTokenizer.from_pretrained(model_dir), build_char_tokenizer()
    text = "<|im_start|>user\nhello, world: 12+30=?<|im_end|>\n"
    assert loaded.encode(text, add_special_tokens=False) == built.encode(text, add_special_tokens=False)
    assert loaded.eos_token_id == 3 and loaded.pad_token_id == 0
    assert loaded.chat_template == built.chat_template


def test_initial_policy_is_near_uniform(model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        probs = model(torch.tensor([[2, 37, 35, 21, 34, 5, 10, 43]])).logits.softmax(-1)
    # Uniform would be 1/58 = 0.017 everywhere; std 0.02 init keeps every token within a small factor.
    assert probs.max().item() < 0.1 and probs.min().item() > 0.002


def test_build_is_deterministic_per_seed(tmp_path) -> None:
    spec = TinyModelSpec(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    a = AutoModelForCausalLM.from_pretrained(build_tiny_model(spec, str(tmp_path / "a"))).state_dict()
    b = AutoModelForCausalLM.from_pretrained(build_tiny_model(spec, str(tmp_path / "b"))).state_dict()
    c_spec = TinyModelSpec(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, seed=1)
    c = AutoModelForCausalLM.from_pretrained(build_tiny_model(c_spec, str(tmp_path / "c"))).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_build_leaves_global_rng_untouched(tmp_path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(TinyModelSpec(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1), str(tmp_path / "m"))
    assert torch.equal(torch.rand(3), expected)


def test_ensure_builds_once_and_rebuilds_on_spec_change(tmp_path) -> None:
    out = str(tmp_path / "m")
    small = TinyModelSpec(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    ensure_tiny_model(out, small)
    stamp = os.path.getmtime(os.path.join(out, "model.safetensors"))
    assert ensure_tiny_model(out, small) == os.path.abspath(out)
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == stamp
    other = TinyModelSpec(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2)
    ensure_tiny_model(out, other)
    assert AutoConfig.from_pretrained(out).num_key_value_heads == 2
    with open(os.path.join(out, SPEC_FILE)) as f:
        assert json.load(f)["digest"] == other.digest() != small.digest()


def test_spec_validation_names_legal_values() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        TinyModelSpec(hidden_size=100, num_attention_heads=3).validate()
    with pytest.raises(ValueError, match=r"legal kv heads: \[1, 2, 4\]"):
        TinyModelSpec(num_attention_heads=4, num_key_value_heads=3).validate()


def test_cli_builds_requested_shape(tmp_path, capsys) -> None:
    main(["--out", str(tmp_path / "cli"), "--layers", "1", "--heads", "2", "--kv-heads", "1", "--hidden", "64"])
    config = AutoConfig.from_pretrained(str(tmp_path / "cli"))
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (1, 2, 1, 64)
    assert config.intermediate_size == 128
    assert capsys.readouterr().out.strip().endswith("cli")


def test_concurrent_ensure_leaves_one_valid_model(tmp_path) -> None:
    out = str(tmp_path / "shared")
    spec = TinyModelSpec(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: ensure_tiny_model(out, spec), range(3)))
    assert paths == [os.path.abspath(out)] * 3
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tiny-build-")]  # no staging left behind
    assert AutoConfig.from_pretrained(out).hidden_size == 64
