"""Tiny random-init Qwen2 model factory for CPU tests and CI.

`build_tiny_model` writes a deterministic (seeded) random-init `Qwen2ForCausalLM` with the character
tokenizer of `rlsp.models.tokenizer` to a directory that transformers (`AutoModelForCausalLM`,
`AutoTokenizer`) and vLLM load by path: fp32 safetensors, `config.json` with dtype float32, and a
`generation_config.json` whose eos ids stop generation at the end of the assistant turn.
`ensure_tiny_model` builds only when the directory is missing or was built from another spec.
`build_tiny_reward_model` writes the same backbone as a one-label sequence classifier (a reward model).

CLI: `python -m rlsp.models.tiny --out DIR [--layers N --heads H --kv-heads K --hidden D]`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlsp.config.choices import VLLM_CPU_HEAD_DIMS
from rlsp.models.built_dir import build_atomically, built_digest, spec_digest, write_spec_file

if TYPE_CHECKING:  # torch and transformers are imported where a model is built: a built one needs neither
    from transformers import Qwen2Config, Qwen2ForCausalLM

SPEC_FILE = "rlsp_tiny_spec.json"
# Bump when the factory's output changes for an unchanged spec (tokenizer, init, files written),
# so existing directories are rebuilt.
FACTORY_VERSION = 1


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a tiny Qwen2 model; the vocabulary is fixed by the char tokenizer."""

    # head_dim = hidden_size / num_attention_heads must be one of vLLM's CPU attention head sizes
    # (VLLM_CPU_HEAD_DIMS, smallest 32): hence 128 / 4 heads rather than 64 / 4.
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    # Small init keeps the initial policy close to uniform over the vocabulary.
    init_std: float = 0.02
    seed: int = 0
    vocab_size: int | None = None  # None: the char tokenizer's size; larger pads the embedding (unused ids)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; pick heads among the divisors of hidden_size"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; legal kv heads: "
                f"{[k for k in range(1, self.num_attention_heads + 1) if self.num_attention_heads % k == 0]}"
            )

    @property
    def vllm_cpu_compatible(self) -> bool:
        return self.head_dim in VLLM_CPU_HEAD_DIMS

    def digest(self) -> str:
        """Hash of the spec and factory version; a mismatch triggers a rebuild."""
        return spec_digest(self, FACTORY_VERSION)


def build_tiny_config(spec: TinyModelSpec, vocab_size: int, pad_id: int, eos_ids: list[int]) -> Qwen2Config:
    import torch
    from transformers import Qwen2Config

    spec.validate()
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        initializer_range=spec.init_std,
        pad_token_id=pad_id,
        bos_token_id=None,
        eos_token_id=eos_ids[0],
        dtype=torch.float32,
    )


def _init_model(config: Qwen2Config, seed: int) -> Qwen2ForCausalLM:
    import torch
    from transformers import Qwen2ForCausalLM

    # fork_rng keeps the caller's global RNG stream untouched by the seeded init.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(torch.float32).eval()


def _write_model(spec: TinyModelSpec, out_dir: str) -> None:
    from transformers import GenerationConfig

    from rlsp.models.tokenizer import build_char_tokenizer, stop_token_ids

    tokenizer = build_char_tokenizer()
    eos_ids = stop_token_ids(tokenizer)
    vocab = spec.vocab_size or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size={vocab} is smaller than the char tokenizer's {len(tokenizer)} tokens")
    config = build_tiny_config(spec, vocab, tokenizer.pad_token_id, eos_ids)
    model = _init_model(config, spec.seed)
    # Only stop ids and pad: sampling defaults stay with the caller's SamplingParams / generate args.
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    write_spec_file(out_dir, SPEC_FILE, spec, spec.digest())


def build_tiny_reward_model(spec: TinyModelSpec, out_dir: str, chat_template: str | None = None) -> str:
    """Write a random-init one-label `Qwen2ForSequenceClassification` (a reward model: a score per
    sequence) with the char tokenizer to `out_dir` and return its absolute path. `chat_template`
    replaces the tokenizer's template (a reward model whose chat format differs from the policy's)."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    from rlsp.models.tokenizer import build_char_tokenizer, stop_token_ids

    tokenizer = build_char_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = build_tiny_config(spec, spec.vocab_size or len(tokenizer), tokenizer.pad_token_id,
                               stop_token_ids(tokenizer))
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForSequenceClassification(config).to(torch.float32).eval()
    out_dir = os.path.abspath(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_tiny_model(spec: TinyModelSpec, out_dir: str) -> str:
    """Write the tiny model + tokenizer to `out_dir` (replacing it) and return its absolute path.

    The model is written next to `out_dir` and renamed into place, so readers never see a
    half-written directory.
    """
    return _build(spec, os.path.abspath(out_dir), keep_matching=False)


def _build(spec: TinyModelSpec, out_dir: str, keep_matching: bool) -> str:
    return build_atomically(out_dir, lambda staging: _write_model(spec, staging), spec.digest(), SPEC_FILE,
                            keep_matching)


def ensure_tiny_model(out_dir: str, spec: TinyModelSpec | None = None) -> str:
    """Return `out_dir` (absolute), building the model only if missing or built from another spec."""
    spec = spec or TinyModelSpec()
    out_dir = os.path.abspath(out_dir)
    if built_digest(out_dir, SPEC_FILE) == spec.digest():
        return out_dir
    return _build(spec, out_dir, keep_matching=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = TinyModelSpec()
    p = argparse.ArgumentParser(description="Build a tiny random-init Qwen2 model with a char tokenizer.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--layers", type=int, default=defaults.num_hidden_layers)
    p.add_argument("--heads", type=int, default=defaults.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=defaults.num_key_value_heads)
    p.add_argument("--hidden", type=int, default=defaults.hidden_size)
    p.add_argument("--intermediate", type=int, default=None, help="default: 2 x hidden")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--force", action="store_true", help="rebuild even if the spec matches")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        seed=args.seed,
    )
    if not spec.vllm_cpu_compatible:
        print(f"warning: head_dim={spec.head_dim} is not in {VLLM_CPU_HEAD_DIMS}; vLLM on CPU cannot run this model")
    path = build_tiny_model(spec, args.out) if args.force else ensure_tiny_model(args.out, spec)
    print(path)


if __name__ == "__main__":
    main()
