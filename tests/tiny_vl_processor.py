"""A tiny Qwen2.5-VL-style processor directory for the data tests and the visual demo.

Built from transformers' own pieces and saved as a model directory holds them: rlsp's character vocabulary
(rlsp.models.tokenizer) plus the Qwen-VL vision tokens in a `Qwen2Tokenizer`, the PIL image processor
`Qwen2VLImageProcessorPil` with a small patch (4 px, merge 2: one image token per 8x8 pixels) and a pixel budget
of 8x8 .. 32x32 (1 .. 16 image tokens), a chat template that renders image content parts as
`<|vision_start|><|image_pad|><|vision_end|>`, and `processor_config.json` naming `Qwen2_5_VLProcessor`.
`AutoProcessor.from_pretrained` reads it back (through rlsp.data.vision_processor.load_processor where
torchvision is missing). `write_tiny_vl_dir` adds a tiny qwen2_5_vl config.json (no weights) so that the
directory reads as a vision-language model's.
"""

from __future__ import annotations

import json
import os

from transformers import Qwen2_5_VLConfig
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rlsp.models.tokenizer import (
    ENDOFTEXT_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    UNK_TOKEN,
    char_vocab,
)

# Ids 58-63 after the 58 character tokens: two reserved, then image, video, vision start/end = 60-63, the ids of
# tests/tiny_vl.py's models (vocab 64), so `write_tiny_vl` + `write_tiny_vl_processor` make one model directory.
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


def build_vl_tokenizer() -> Qwen2Tokenizer:
    """rlsp's char tokenizer with two reserved tokens and the four Qwen-VL vision tokens appended (ids 58..63)."""
    vocab = char_vocab()
    for token in RESERVED_TOKENS + VISION_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=UNK_TOKEN, bos_token=None, eos_token=IM_END_TOKEN,
                               pad_token=PAD_TOKEN,
                               additional_special_tokens=[ENDOFTEXT_TOKEN, IM_START_TOKEN, *RESERVED_TOKENS, *VISION_TOKENS],
                               clean_up_tokenization_spaces=False, model_max_length=4096, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_tiny_vl_processor(out_dir: str) -> str:
    """Write the processor files (tokenizer, image processor, chat template, processor_config.json)."""
    os.makedirs(out_dir, exist_ok=True)
    build_vl_tokenizer().save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                             min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2_5_VLProcessor"}, f)
    return os.path.abspath(out_dir)


def write_tiny_vl_dir(out_dir: str) -> str:
    """The processor files plus a tiny qwen2_5_vl config.json whose token ids match the tokenizer."""
    path = write_tiny_vl_processor(out_dir)
    tokenizer = build_vl_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, fullatt_block_indexes=[0])
    Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                     video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"]).save_pretrained(path)
    return path
