"""Character-level tokenizer for the tiny random-init test models.

One token per character over a small fixed alphabet (digits, lowercase letters, space, newline and a
little punctuation) plus Qwen-style chat special tokens. It is a real `tokenizers` tokenizer wrapped
in a `PreTrainedTokenizerFast`, so transformers and vLLM load it from a saved directory like any
other Hugging Face tokenizer.

The assistant turn ends with `<|im_end|>`, which is therefore the EOS token; `<|endoftext|>` is a
second stop id listed in the model's `generation_config.json` (see `rlsp.models.tiny`).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
# Order fixes the ids: pad=0, endoftext=1, im_start=2, im_end=3, unk=4.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)

PUNCTUATION = "+-*=?.,:;()!'\"/"
ALPHABET: str = "\n " + string.digits + string.ascii_lowercase + PUNCTUATION

# Qwen-like ChatML rendering over the character vocabulary; whitespace control (`-`) keeps the
# template itself from adding characters that the model would have to learn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- endif -%}"
)


def char_vocab() -> dict[str, int]:
    """Token -> id map: the special tokens first, then one entry per alphabet character."""
    tokens = list(SPECIAL_TOKENS) + list(ALPHABET)
    if len(set(tokens)) != len(tokens):
        raise RuntimeError(f"duplicate entries in the character vocabulary: {tokens}")
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer with the chat template; `len(tokenizer)` is 58."""
    core = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK_TOKEN))
    # Oniguruma `(?m).` (its dotall flag) matches every single character including the newline; "isolated" keeps each one
    # as its own pre-token so spaces survive as tokens.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    # Fuse joins the tokens back with no separator, so decode(encode(s)) == s.
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=IM_END_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[ENDOFTEXT_TOKEN, IM_START_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids that end a generation: `<|im_end|>` (EOS) and `<|endoftext|>`."""
    return [tokenizer.convert_tokens_to_ids(IM_END_TOKEN), tokenizer.convert_tokens_to_ids(ENDOFTEXT_TOKEN)]
