"""Character-level tokenizer for the tiny random-init test models.

One token per character over a small fixed alphabet (digits, lowercase letters, space, newline and a
little punctuation) plus Qwen-style chat special tokens.

Why a byte-level BPE with no merges rather than a WordLevel model: a saved model whose config says
`model_type: qwen2` is always loaded by `AutoTokenizer` as `Qwen2Tokenizer` (transformers 5 forces
the class for qwen2), which rebuilds the tokenizer as byte-level BPE from the saved vocabulary and
merges, discarding any other model/pre-tokenizer/decoder. So the tokenizer is built here as exactly
that: a `Qwen2Tokenizer` whose vocabulary holds one byte-level symbol per alphabet character and no
merges. Every character is then its own token, the ByteLevel decoder joins tokens without adding
spaces, and the tokenizer built here, the one `AutoTokenizer` loads and the one vLLM loads encode
identically. Characters outside the alphabet are dropped when encoding (Qwen2's BPE has no unknown
token); `<|unk|>` is registered as the unknown token for completeness.

The assistant turn ends with `<|im_end|>`, which is therefore the EOS token; `<|endoftext|>` is a
second stop id listed in the model's `generation_config.json` (see `rlsp.models.tiny`).
"""

from __future__ import annotations

import string

from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

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


def _byte_level_symbol(char: str) -> str:
    """The printable stand-in byte-level BPE uses for an ASCII character (GPT-2 convention).

    Printable bytes map to themselves; the others (space, newline, ...) are shifted past 255 in
    byte order: the n-th non-printable byte becomes chr(256 + n)."""
    code = ord(char)
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    if code > 0x7F:
        raise ValueError(f"character {char!r} is not ASCII; the char vocabulary is {ALPHABET!r}")
    if code in printable:
        return char
    return chr(256 + sum(1 for b in range(code) if b not in printable))


def char_vocab() -> dict[str, int]:
    """Token -> id map: the special tokens first, then one byte-level symbol per alphabet character."""
    tokens = list(SPECIAL_TOKENS) + [_byte_level_symbol(c) for c in ALPHABET]
    if len(set(tokens)) != len(tokens):
        raise RuntimeError(f"duplicate entries in the character vocabulary: {tokens}")
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer with the chat template; `len(tokenizer)` is 58."""
    tokenizer = Qwen2Tokenizer(
        vocab=char_vocab(),
        merges=[],  # no merges: every character stays a token of its own
        unk_token=UNK_TOKEN,
        bos_token=None,
        eos_token=IM_END_TOKEN,
        pad_token=PAD_TOKEN,
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
