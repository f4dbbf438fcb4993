"""What a reward model reads: the policy's rows as they are, or each sample re-rendered in its own chat format.

A reward model scores token ids of *its* tokenizer in *its* chat format. When its tokenizer is the
policy's (same vocabulary, special tokens and chat template) the rollout rows are fed unchanged.
Otherwise each sample is re-rendered, as verl's reward-model worker does: the prompt's chat messages
(kept by the dataset; for a completion prompt, the decoded prompt text) plus the decoded response
as the assistant turn, formatted with the reward model's chat template (no generation prompt) and
tokenized with its tokenizer. The result is right-padded rows {input_ids, attention_mask}; the
reward model's score is read at each row's last real token.

Legend: B rows, P prompt width (left-padded), R response width, L' a re-rendered row's width.
"""

from __future__ import annotations

from typing import Any

import torch

from rlsp.data.batch import Batch, response_lengths


def same_tokenizer(a: Any, b: Any) -> bool:
    """True when `a` and `b` turn the same chat into the same ids (vocabulary, special tokens, template)."""
    return (a.get_vocab() == b.get_vocab() and a.all_special_tokens == b.all_special_tokens
            and getattr(a, "chat_template", None) == getattr(b, "chat_template", None))


def _texts(batch: Batch, prompt_len: int, policy_tok: Any, rm_tok: Any) -> list[str]:
    """Each sample in the reward model's format: its chat template over messages + response, or the
    decoded prompt and response text of a completion prompt."""
    ids_BL, mask_BL = batch["input_ids"], batch["attention_mask"]
    lengths = response_lengths(batch)
    messages = batch.meta.get("messages") or [None] * len(batch)
    texts = []
    for b in range(len(batch)):
        response = policy_tok.decode(ids_BL[b, prompt_len:prompt_len + lengths[b]].tolist(), skip_special_tokens=True)
        if messages[b] is None:
            prompt = policy_tok.decode(ids_BL[b, :prompt_len][mask_BL[b, :prompt_len].bool()].tolist(),
                                       skip_special_tokens=True)
            texts.append(prompt + response)
        else:
            chat = [*messages[b], {"role": "assistant", "content": response}]
            texts.append(rm_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=False))
    return texts


def _engine_text(text: str, rm_tok: Any) -> str:
    """`text` without a leading BOS: an inference engine's tokenizer adds its special tokens itself."""
    bos = rm_tok.bos_token
    return text[len(bos):] if bos is not None and text.startswith(bos) else text


def render_for_reward_model(batch: Batch, prompt_len: int, policy_tok: Any, rm_tok: Any,
                            max_len: int | None = None, engine_specials: bool = False) -> Batch:
    """Right-padded rows [B, L'] {input_ids, attention_mask} of every sample in the reward model's own
    chat format (see the module docstring); ValueError naming the row if one exceeds `max_len` tokens.
    `engine_specials`: tokenize as verl's reward loop has its inference engine do it (a leading BOS
    text dropped, then the tokenizer's own special tokens added), so a BOS is never doubled."""
    texts = _texts(batch, prompt_len, policy_tok, rm_tok)
    if engine_specials:
        ids = [rm_tok(_engine_text(t, rm_tok), add_special_tokens=True)["input_ids"] for t in texts]
    else:
        ids = [rm_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    longest = max((len(x) for x in ids), default=0)
    if max_len is not None and longest > max_len:
        row = max(range(len(ids)), key=lambda i: len(ids[i]))
        limit = "the reward engine's max_model_len" if engine_specials else "its max_position_embeddings"
        raise ValueError(f"row {row} is {longest} tokens in the reward model's format, more than {limit}={max_len}; "
                         "lower data.max_response_length / max_prompt_length (or raise reward_model.rollout.max_model_len)")
    pad = rm_tok.pad_token_id if rm_tok.pad_token_id is not None else 0
    input_ids = torch.full((len(ids), max(longest, 1)), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, row in enumerate(ids):
        input_ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[b, :len(row)] = 1
    return Batch.from_dict({"input_ids": input_ids, "attention_mask": attention_mask})
