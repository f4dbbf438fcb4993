"""Tiny random-init Qwen2.5-VL (`builtin://tiny-qwen2.5-vl`): a vision-language model rlsp builds without any hub.

Built from transformers' own pieces and saved as a model directory holds them:
- the processor: rlsp's character vocabulary (rlsp.models.tokenizer) plus two reserved tokens and the Qwen-VL
  vision tokens (ids 58..63) in a `Qwen2Tokenizer` -- for the built-in model also BPE merges that make each colour
  name of the shapes task (rlsp.data.tasks.shapes) one token (ids 64..77, `TinyVLSpec.words`); the PIL image
  processor `Qwen2VLImageProcessorPil` with a small patch (4 px, merge 2: one image token per 8x8 pixels) and a
  pixel budget of 8x8 .. 32x32 (1 .. 16 image tokens); a chat template that renders image content parts as
  `<|vision_start|><|image_pad|><|vision_end|>`; and `processor_config.json` naming `Qwen2_5_VLProcessor`.
  `AutoProcessor.from_pretrained` reads it back (through rlsp.data.vision_processor.load_processor where
  torchvision is missing).
- the model (`ensure_tiny_vl_model`, `TinyVLSpec`): a seeded random-init `Qwen2_5_VLForConditionalGeneration`, fp32
  safetensors: a text model of 2 layers, hidden 128, 4 q / 2 kv heads of dim 32 (the built-in tiny Qwen2's shape),
  multimodal rope sections [4, 6, 6], vocabulary 78; a vision tower of 2 blocks (the first windowed, the second
  full attention), hidden 64 (0.5M parameters in all); and a `generation_config.json` whose stop ids end the
  assistant turn. It builds only when the directory is missing or was built from another spec.
`write_tiny_vl_dir` writes the processor files (no word tokens: vocabulary 64) plus a smaller config.json only (no
weights), for data tests that need a directory that reads as a vision-language model's.

CLI: `python -m rlsp.models.tiny_vl --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from rlsp.data.tasks.shapes import COLOURS
from rlsp.models.built_dir import build_atomically, built_digest, spec_digest, write_spec_file
from rlsp.models.tokenizer import (
    ENDOFTEXT_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    UNK_TOKEN,
    char_vocab,
)

# Ids 58-63 after the 58 character tokens: two reserved, then image, video, vision start/end = 60-63 (vocab 64).
RESERVED_TOKENS = ("<|reserved_0|>", "<|reserved_1|>")
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 8 * 8, 32 * 32
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
SPEC_FILE = "rlsp_tiny_vl_spec.json"
# Bump when the factory's output changes for an unchanged spec, so existing directories are rebuilt.
FACTORY_VERSION = 1


@dataclass(frozen=True)
class TinyVLSpec:
    """Shape and seed of the built-in tiny Qwen2.5-VL; the vocabulary is fixed by the tokenizer (64 tokens)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    mrope_section: tuple[int, int, int] = (4, 6, 6)  # temporal, height, width: sums to head_dim / 2 = 16
    max_position_embeddings: int = 512
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_heads: int = 2
    # Weights' init std. Measured on the colour task (supervised, 32 rows a step, AdamW 1e-3): from 0.02 the loss
    # stays at ln 4 (the answers' marginal, image ignored) for 150 steps; from 0.08 it leaves it by step 50. With
    # small weights the text model's attention has no gradient to find the few image tokens that hold the colour.
    init_std: float = 0.08
    seed: int = 0
    # Whole-word tokens (as a real model's BPE vocabulary has them): the shapes task's colour names. A random policy
    # writes a name letter by letter only by chance (1 in 64^3..64^6 per sample: GRPO sees no reward at all); one
    # token of 78 it writes as often as the tiny Qwen2 writes an arithmetic answer's first digit.
    words: tuple[str, ...] = tuple(COLOURS)

    def digest(self) -> str:
        """Hash of the spec and factory version; a mismatch triggers a rebuild."""
        return spec_digest(self, FACTORY_VERSION)


def word_merges(words: tuple[str, ...]) -> list[tuple[str, str]]:
    """BPE merges that spell each of `words` (lowercase letters) as one token, letter by letter: ("g", "r"),
    ("gr", "e"), ... Longer words' merges rank first, so a shorter word's pair never splits a longer word ("green"
    is merged whole before "red"'s ("r", "e") could take its "re")."""
    merges: list[tuple[str, str]] = []
    for word in sorted(words, key=len, reverse=True):
        if len(word) < 2 or not word.isalpha() or not word.islower() or not word.isascii():
            raise ValueError(f"word {word!r}: legal: two or more lowercase ASCII letters")
        merges += [(word[:i], word[i]) for i in range(1, len(word)) if (word[:i], word[i]) not in merges]
    return merges


def build_vl_tokenizer(words: tuple[str, ...] = ()) -> Any:
    """rlsp's char tokenizer with two reserved tokens and the four Qwen-VL vision tokens appended (ids 58..63), then
    one token per prefix of each of `words` (ids 64..: BPE merges, so each word encodes as one token)."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer  # noqa: PLC0415

    vocab = char_vocab()
    for token in RESERVED_TOKENS + VISION_TOKENS:
        vocab[token] = len(vocab)
    merges = word_merges(words)
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=UNK_TOKEN, bos_token=None, eos_token=IM_END_TOKEN,
                               pad_token=PAD_TOKEN,
                               additional_special_tokens=[ENDOFTEXT_TOKEN, IM_START_TOKEN, *RESERVED_TOKENS, *VISION_TOKENS],
                               clean_up_tokenization_spaces=False, model_max_length=4096, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_tiny_vl_processor(out_dir: str, words: tuple[str, ...] = ()) -> str:
    """Write the processor files (tokenizer with `words`, image processor, chat template, processor_config.json)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: PLC0415

    os.makedirs(out_dir, exist_ok=True)
    build_vl_tokenizer(words).save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                             min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2_5_VLProcessor"}, f)
    return os.path.abspath(out_dir)


def _token_ids(tokenizer: Any) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def write_tiny_vl_dir(out_dir: str) -> str:
    """The processor files plus a tiny qwen2_5_vl config.json (no weights) whose token ids match the tokenizer."""
    from transformers import Qwen2_5_VLConfig  # noqa: PLC0415

    path = write_tiny_vl_processor(out_dir)
    tokenizer = build_vl_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, fullatt_block_indexes=[0])
    Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_token_ids(tokenizer)).save_pretrained(path)
    return path


def build_tiny_vl_config(spec: TinyVLSpec) -> Any:
    """The `Qwen2_5_VLConfig` of `spec` over the 64-token vocabulary (fp32)."""
    import torch  # noqa: PLC0415
    from transformers import Qwen2_5_VLConfig  # noqa: PLC0415

    if spec.hidden_size % spec.num_attention_heads or spec.num_attention_heads % spec.num_key_value_heads:
        raise ValueError(f"hidden_size={spec.hidden_size}, num_attention_heads={spec.num_attention_heads}, "
                         f"num_key_value_heads={spec.num_key_value_heads}: heads must divide hidden_size and kv heads "
                         "must divide q heads")
    half_head = spec.hidden_size // spec.num_attention_heads // 2
    if sum(spec.mrope_section) != half_head:
        raise ValueError(f"mrope_section={spec.mrope_section} sums to {sum(spec.mrope_section)}; legal: three "
                         f"sections summing to head_dim / 2 = {half_head}")
    tokenizer = build_vl_tokenizer(spec.words)
    text = dict(vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
                initializer_range=spec.init_std, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(spec.mrope_section)})
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden_size,
                  intermediate_size=2 * spec.vision_hidden_size, num_heads=spec.vision_heads,
                  out_hidden_size=spec.hidden_size, patch_size=PATCH, spatial_merge_size=MERGE,
                  temporal_patch_size=TEMPORAL, window_size=16, fullatt_block_indexes=[spec.vision_depth - 1],
                  initializer_range=spec.init_std)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, dtype=torch.float32,
                            **_token_ids(tokenizer))


def _write_model(spec: TinyVLSpec, out_dir: str) -> None:
    import torch  # noqa: PLC0415
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration  # noqa: PLC0415

    config = build_tiny_vl_config(spec)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays untouched by the seeded init
        torch.manual_seed(spec.seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    tokenizer = build_vl_tokenizer(spec.words)
    stop_ids = [tokenizer.convert_tokens_to_ids(IM_END_TOKEN), tokenizer.convert_tokens_to_ids(ENDOFTEXT_TOKEN)]
    model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=None)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tiny_vl_processor(out_dir, spec.words)
    write_spec_file(out_dir, SPEC_FILE, spec, spec.digest())


def ensure_tiny_vl_model(out_dir: str, spec: TinyVLSpec | None = None, force: bool = False) -> str:
    """Return `out_dir` (absolute), building the model only if missing, built from another spec, or `force`.

    The model is written next to `out_dir` and renamed into place: readers never see a half-written directory."""
    spec = spec or TinyVLSpec()
    out_dir = os.path.abspath(out_dir)
    if not force and built_digest(out_dir, SPEC_FILE) == spec.digest():
        return out_dir
    return build_atomically(out_dir, lambda staging: _write_model(spec, staging), spec.digest(), SPEC_FILE,
                            keep_matching=not force)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build the tiny random-init Qwen2.5-VL (char tokenizer + vision tokens, "
                                "PIL image processor, chat template) that `builtin://tiny-qwen2.5-vl` names.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=TinyVLSpec.seed)
    p.add_argument("--force", action="store_true", help="rebuild even if the spec matches")
    args = p.parse_args(argv)
    print(ensure_tiny_vl_model(args.out, TinyVLSpec(seed=args.seed), force=args.force))


if __name__ == "__main__":
    main()
