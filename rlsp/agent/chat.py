"""Token-exact chat turns for multi-turn rollouts: prompt, observation and end-of-turn ids from a chat template.

A multi-turn trajectory is built once, turn by turn, and never re-rendered from text:

    prompt_ids(first messages)            mask 0  (ends with the assistant generation prompt)
    + generated ids                        mask 1  (kept exactly as sampled, ending with end-of-turn)
    + observation_ids(tool/user messages)  mask 0  (ends with the next assistant generation prompt)
    + generated ids                        mask 1
    ...

Re-tokenizing the decoded text instead could split it differently from how it was sampled, so the
trainer would score tokens the policy never produced. The observation ids are what the template
inserts after an assistant turn that ended with its end-of-turn token: they are the suffix of a
rendered dummy conversation with the observation messages appended, after that dummy's assistant
end-of-turn token. Tokens the template writes after the end-of-turn token (ChatML's "\\n" after
`<|im_end|>`) belong to the observation: the model stops at the end-of-turn token and never samples them.

Templates that render earlier turns differently once more messages follow (some drop the reasoning of
past assistant turns) cannot give token-exact observations; `observation_ids` detects that by
comparing the two renders token by token and raises instead of returning ids that would not match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OBSERVATION_ROLES = ("tool", "user")
# The fixed conversation whose assistant turn the observations are appended to. Two different replies
# give two renders whose common tail is the template's end-of-turn (and what follows it).
_DUMMY_USER = {"role": "user", "content": "Hello."}
_DUMMY_REPLIES = ("Alpha", "Omega")
# Used by tools_rendered when no tools were given: any schema shows whether the template renders tools.
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool", "description": "Probe.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}


@dataclass(frozen=True)
class _Layout:
    """A template's assistant-turn layout, found from renders of the dummy conversation."""

    prompt: list[int]  # the dummy user turn with the generation prompt
    end: int  # the end-of-turn token id
    trailer: list[int]  # what the template writes after the end-of-turn token (not generated)
    dummy_ids: list[int]  # the dummy conversation with its first reply, ending with end + trailer


def _dummy(reply: str) -> list[dict]:
    return [_DUMMY_USER, {"role": "assistant", "content": reply}]


def _as_ids(rendered: Any) -> list[int]:
    """apply_chat_template's tokenized output as a plain list of ints (it may be a BatchEncoding)."""
    if hasattr(rendered, "keys") and "input_ids" in rendered.keys():
        rendered = rendered["input_ids"]
    ids = list(rendered)
    if ids and not isinstance(ids[0], int):
        raise RuntimeError(f"expected one sequence of token ids from the chat template, got {type(ids[0]).__name__}")
    return ids


def _common_suffix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


class ChatTokens:
    """Token ids of a conversation's turns under `tokenizer`'s chat template, with `tools` rendered in it.

    `tools` are OpenAI function schemas (`{"type": "function", "function": {...}}`), passed to the
    template as `tools=`.
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        """`template_kwargs`: extra arguments of every apply_chat_template call (data.apply_chat_template_kwargs)."""
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template; multi-turn rollouts need "
                             "one (a chat/instruct model, or set tokenizer.chat_template)")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.template_kwargs = dict(template_kwargs or {})
        self._layout: _Layout | None = None

    def _apply(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False,
            **self.template_kwargs)
        return _as_ids(rendered)

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return self._apply(messages, generation_prompt, self.tools)

    def _split_reply(self, rendered: list[int], prompt: list[int], what: str) -> list[int]:
        """The part of `rendered` after `prompt`, checking that `prompt` is a token-exact prefix of it."""
        if rendered[:len(prompt)] != prompt:
            at = next((i for i, (a, b) in enumerate(zip(rendered, prompt)) if a != b), min(len(rendered), len(prompt)))
            raise RuntimeError(
                f"the chat template's generation prompt is not a token prefix of {what} (first difference at token "
                f"{at}: {self._show(rendered[at:at + 8])} vs {self._show(prompt[at:at + 8])}); token-exact "
                "multi-turn rollouts need a template whose assistant turn starts with its generation prompt")
        return rendered[len(prompt):]

    def _show(self, ids: list[int]) -> str:
        return repr(self.tokenizer.decode(ids))

    def _special_ids(self) -> set[int]:
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        special.update(i for i, tok in decoder.items() if getattr(tok, "special", False))
        return special

    def _template_layout(self) -> _Layout:
        """Where the template puts a dummy assistant turn's end-of-turn token, computed once."""
        if self._layout is None:
            prompt = self._render([_DUMMY_USER], generation_prompt=True)
            renders = [self._render(_dummy(reply), False) for reply in _DUMMY_REPLIES]
            tails = [self._split_reply(r, prompt, f"the rendered assistant reply {reply!r}")
                     for r, reply in zip(renders, _DUMMY_REPLIES)]
            common = tails[0][len(tails[0]) - _common_suffix_len(*tails):]
            # The end-of-turn is the first special token of what every assistant turn ends with; tokens
            # before it (a space some templates add) are part of the reply the model writes.
            special = self._special_ids()
            ends = [i for i, tok in enumerate(common) if tok in special]
            if not ends:
                raise RuntimeError(
                    f"the chat template ends assistant turns with {self._show(common)}, which holds no special token; "
                    "token-exact multi-turn rollouts need an end-of-turn token the model stops at (e.g. <|im_end|>)")
            self._layout = _Layout(prompt, common[ends[0]], common[ends[0] + 1:], renders[0])
        return self._layout

    def end_of_turn_ids(self) -> set[int]:
        """The token id(s) that end an assistant turn in this template (a generation that stopped cleanly
        ends with one of them)."""
        return {self._template_layout().end}

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation so far, rendered with the tools and the assistant generation prompt."""
        return self._render(messages, generation_prompt=True)

    def assistant_ids(self, content: str, tool_calls: list[dict] | None = None) -> list[int]:
        """An assistant turn's ids as the template renders them: content (and `tool_calls`, for templates
        that render structured calls) through the end-of-turn token, without what follows it."""
        layout = self._template_layout()
        end, trailer = layout.end, layout.trailer
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        reply = self._split_reply(self._render([_DUMMY_USER, message], False), layout.prompt, "an assistant turn")
        if len(reply) <= len(trailer) or reply[len(reply) - len(trailer) - 1] != end \
                or reply[len(reply) - len(trailer):] != trailer:
            raise RuntimeError(f"the chat template rendered the assistant turn {content!r} as {self._show(reply)}, "
                               f"which does not end with {self._show([end, *trailer])}")
        return reply[:len(reply) - len(trailer)]

    def observation_ids(self, messages: list[dict], calls: list[dict] | None = None,
                        end_id: int | None = None) -> list[int]:
        """The ids the template inserts after an assistant turn that ended with `end_id` (default: the
        end-of-turn token): `messages` (tool results and/or user turns) up to and including the next
        generation prompt.

        `calls` are the turn's tool calls (OpenAI `tool_calls` entries): the dummy assistant turn carries
        them, for templates that render a tool result from the call it answers (gpt-oss names the function
        in the result's header). `end_id` is the token the generation stopped at when a tool-call format
        ends calling turns with its own token (gpt-oss's <|call|>, GLM's <|observation|>, Gemma 4's
        <tool_call|>): the observation starts right after that token where the template renders it."""
        if not messages:
            raise ValueError("observation_ids needs at least one message (tool results or a user turn), got none")
        for message in messages:
            if message.get("role") not in OBSERVATION_ROLES:
                raise ValueError(f"observation message role {message.get('role')!r} is not allowed; "
                                 f"legal roles: {list(OBSERVATION_ROLES)}")
        layout = self._template_layout()
        end = layout.end if end_id is None else end_id
        reply: dict[str, Any] = {"role": "assistant", "content": _DUMMY_REPLIES[0]}
        if calls:
            reply = {"role": "assistant", "content": "", "tool_calls": list(calls)}
        base = self._render([_DUMMY_USER, reply], False)
        full = self._render([_DUMMY_USER, reply, *messages], True)
        self._split_reply(full, layout.prompt, "the conversation with the observation")
        # The first `end` after the prompt closes the dummy turn; up to it the render must not change
        # once the observation follows (else generated ids + observation ids != the template's render).
        at = next((i for i in range(len(layout.prompt), len(full)) if full[i] == end), None)
        if at is None or full[:at] != base[:at]:
            first = next((i for i, (a, b) in enumerate(zip(full, base)) if a != b), min(len(full), len(base)))
            raise RuntimeError(
                "the chat template renders the earlier turns differently once tool/user messages follow (first "
                f"difference at token {first}: {self._show(full[first:first + 8])} vs "
                f"{self._show(base[first:first + 8])}; the turn's end {self._show([end])} "
                f"{'is not rendered after it' if at is None else f'is at token {at}'}), so observation ids cannot "
                "be appended token-exactly to the generated ids; use a template that renders history unchanged")
        return full[at + 1:]

    def tools_rendered(self) -> bool:
        """Whether the template renders tool schemas at all (the render with tools differs from the one
        without). When it does not, the tools must be described in the prompt itself."""
        tools = self.tools or [_PROBE_TOOL]
        return self._apply([_DUMMY_USER], True, tools) != self._apply([_DUMMY_USER], True, None)
