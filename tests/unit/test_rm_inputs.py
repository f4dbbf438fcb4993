"""A reward model whose chat format differs from the policy's reads each sample re-rendered in its own format.

The policy writes prompts with the char tokenizer's ChatML template; the reward model's tokenizer has the
same vocabulary but another template ("User: ... / Assistant: ..."). Expected rows are built by hand:
the sample's messages plus the decoded response as the assistant turn, through the reward model's
template, tokenized by its tokenizer, right-padded. Also: identical tokenizers are recognised (rows are
then fed unchanged), a completion prompt (no messages) becomes prompt text + response text, and a row
longer than the reward model's position range is refused naming it.
"""

from __future__ import annotations

import pytest
import torch

from rlsp.data.batch import Batch
from rlsp.data.rm_inputs import render_for_reward_model, same_tokenizer
from rlsp.models.tokenizer import build_char_tokenizer

RM_TEMPLATE = ("{%- for m in messages -%}{{ m['role'] | capitalize + ': ' + m['content'] + '\n' }}{%- endfor -%}"
               "{%- if add_generation_prompt -%}{{ 'Assistant: ' }}{%- endif -%}")
P, R = 40, 6


def _rows(policy, prompts: list[str], responses: list[str], chat: bool = True) -> Batch:
    ids = torch.zeros(len(prompts), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    resp_mask = torch.zeros(len(prompts), R)
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        text = policy.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                          add_generation_prompt=True) if chat else prompt
        p = policy.encode(text, add_special_tokens=False)
        r = policy.encode(response, add_special_tokens=False) + [policy.convert_tokens_to_ids("<|im_end|>")]
        ids[b, P - len(p):P], mask[b, P - len(p):P + len(r)] = torch.tensor(p), 1
        ids[b, P:P + len(r)], resp_mask[b, :len(r)] = torch.tensor(r), 1
    messages = [[{"role": "user", "content": p}] for p in prompts] if chat else [None] * len(prompts)
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "response_mask": resp_mask},
                           meta={"messages": messages})


@pytest.fixture
def tokenizers():
    policy, rm = build_char_tokenizer(), build_char_tokenizer()
    rm.chat_template = RM_TEMPLATE
    return policy, rm


def test_rows_are_re_rendered_in_the_reward_models_chat_format(tokenizers):
    policy, rm = tokenizers
    assert same_tokenizer(policy, build_char_tokenizer()) and not same_tokenizer(policy, rm)
    prompts, responses = ["3+4=", "12+30="], ["7", "42"]
    out = render_for_reward_model(_rows(policy, prompts, responses), P, policy, rm)
    expected = [rm.encode(f"User: {p}\nAssistant: {r}\n", add_special_tokens=False) for p, r in zip(prompts, responses)]
    assert out["input_ids"].shape == (2, max(map(len, expected)))
    for b, want in enumerate(expected):
        n = int(out["attention_mask"][b].sum())
        assert out["input_ids"][b, :n].tolist() == want  # the response's end-of-turn token is not carried over
        assert out["attention_mask"][b, :n].all() and not out["attention_mask"][b, n:].any()
        assert (out["input_ids"][b, n:] == rm.pad_token_id).all()


def test_completion_prompts_become_prompt_and_response_text(tokenizers):
    policy, rm = tokenizers
    out = render_for_reward_model(_rows(policy, ["2*3="], ["6"], chat=False), P, policy, rm)
    assert out["input_ids"][0].tolist() == rm.encode("2*3=6", add_special_tokens=False)


def test_a_row_beyond_the_reward_models_positions_is_refused(tokenizers):
    policy, rm = tokenizers
    with pytest.raises(ValueError, match=r"row 1 is \d+ tokens in the reward model's format, more than its "
                                         r"max_position_embeddings=12"):
        render_for_reward_model(_rows(policy, ["1+1=", "100+200="], ["2", "300"]), P, policy, rm, max_len=12)


def test_engine_rendering_never_doubles_a_bos(tokenizers):
    # verl's reward loop: a leading BOS text is dropped and the tokenizer adds its own special tokens.
    policy, rm = tokenizers
    rm.bos_token = "<|endoftext|>"
    rm.chat_template = "{{ bos_token }}" + RM_TEMPLATE
    bos = rm.convert_tokens_to_ids("<|endoftext|>")
    rows = _rows(policy, ["3+4="], ["7"])
    legacy = render_for_reward_model(rows, P, policy, rm)["input_ids"][0].tolist()
    engine = render_for_reward_model(rows, P, policy, rm, engine_specials=True)["input_ids"][0].tolist()
    want = rm("User: 3+4=\nAssistant: 7\n", add_special_tokens=True)["input_ids"]
    assert legacy[0] == bos and legacy[1:] == rm.encode("User: 3+4=\nAssistant: 7\n", add_special_tokens=False)
    assert engine == want and engine.count(bos) <= 1
    with pytest.raises(ValueError, match=r"more than the reward engine's max_model_len=8"):
        render_for_reward_model(rows, P, policy, rm, max_len=8, engine_specials=True)
