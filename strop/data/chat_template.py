"""A base model's own chat template (a Jinja string) as the harness's chat format, and the parsers of
the tool-call syntaxes such templates teach.

`TemplateFormat` answers the calls `strop.data.chat.StropFormat` answers, through the tokenizer's
`apply_chat_template` (with `sanitize_control_tokens`, so text inside messages that spells a control
token is tokenized as plain text). Token bookkeeping stays append-only: the ids forced after a
generated turn are the whole conversation rendered with the new messages, less the rendering without
them, cut after the end-of-turn token of the generated turn — valid exactly when the template never
rewrites what it rendered earlier, which `strop.env.harness.chat_formats.check_append_only` checks at start.

Parsers (entry points of `strop.tool_parsers`) turn a generated turn's text into content and calls:
`hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks: Qwen2.5/Qwen3, Hermes;
it is `strop.data.chat.parse_assistant`, strop's own syntax), `llama3_json` (Llama 3.1+: the whole
reply is `{"name": ..., "parameters": {...}}`; one call per turn) and `none` (a template without tool
calls, as SmolLM2-Instruct's: every reply is content).
"""

import json
from typing import Callable

from strop.data.chat import AssistantTurn, ToolCall, canonical_message
from strop.errors import UserError

MARK = "\ue000"  # a private-use character no template writes: finds an assistant turn's end
PLACEHOLDER = {"role": "tool", "content": ""}  # what follows a turn whose rendering is being read off
Parser = Callable[[str], AssistantTurn]


class NotAppendOnly(Exception):
    """The template rendered a conversation that grew by some messages as something that does not
    start with what it rendered before."""


def template_messages(messages: list[dict], reasoning: bool = False) -> list[dict]:
    """Messages as Jinja templates expect them: tool-call arguments as objects (Llama's template
    writes `arguments | tojson`), no empty `tool_calls` key (its presence alone selects a branch).
    With `reasoning`, an assistant turn's `<think>...</think>` block moves to `reasoning_content`,
    split as Qwen3's template splits it: the policy wrote those control tokens, and left in the
    content they would be sanitized as user text before the template's own split saw them."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            m["tool_calls"] = [_with_object_arguments(c) for c in calls]
        content = m.get("content")
        if reasoning and m["role"] == "assistant" and isinstance(content, str) and "</think>" in content:
            think, _, rest = content.partition("</think>")
            m["reasoning_content"] = think.rstrip("\n").split("<think>")[-1].lstrip("\n")
            m["content"] = rest.split("</think>")[-1].lstrip("\n")
        out.append(m)
    return out


def _with_object_arguments(call: dict) -> dict:
    fn = dict(call.get("function", call))
    if isinstance(fn.get("arguments"), str):
        try:
            parsed = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return {**call, "function": fn} if "function" in call else fn


class TemplateFormat:
    """A Jinja chat template over a tokenizer, with the parser of its tool-call syntax."""

    def __init__(self, tokenizer, template: str, parse: Parser, name: str = "template"):
        self.tokenizer, self.template, self._parse, self.name = tokenizer, template, parse, name
        self.parallel_calls = getattr(parse, "parallel_calls", True)
        self.thinking = "</think>" in template  # the template splits a reasoning block off assistant turns
        self.end_text = self._end_of_turn()
        eos = tokenizer.eos_token
        self.stop_texts = tuple(dict.fromkeys([self.end_text] + ([eos] if eos else [])))
        self.stop_ids = tuple(tokenizer.convert_tokens_to_ids(t) for t in self.stop_texts)
        self.end_id = self.stop_ids[0]
        base = [{"role": "system", "content": "."}]
        self._base = len(self.ids(base, None, False))
        asked = base + [{"role": "user", "content": "."}]
        self.generation_prompt_tokens = len(self.ids(asked, None, True)) - len(self.ids(asked, None, False))

    def _render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool, tokenize: bool):
        try:
            return self.tokenizer.apply_chat_template(
                template_messages(messages, self.thinking),
                tools=tools or None,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                return_dict=False,
                **({"sanitize_control_tokens": True} if tokenize else {}),
            )
        except Exception as e:  # Jinja's errors and the template's own raise_exception: the user's template
            raise UserError(f"chat template {self.name} failed: {type(e).__name__}: {e}") from None

    def text(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self._render(messages, tools, add_generation_prompt, tokenize=False)

    def ids(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
        return list(self._render(messages, tools, add_generation_prompt, tokenize=True))

    def _end_of_turn(self) -> str:
        """The control token the template closes an assistant turn with (the policy's stop token)."""
        probe = [{"role": "system", "content": "."}, {"role": "user", "content": "."}]
        text = self.text(probe + [{"role": "assistant", "content": MARK}], None, False)
        if MARK not in text:
            raise UserError(f"chat template {self.name} does not render an assistant message's content")
        tail = text[text.index(MARK) + len(MARK) :]
        specials = {t.content for t in self.tokenizer.added_tokens_decoder.values()} | set(
            self.tokenizer.all_special_tokens
        )
        found = [(tail.find(t), -len(t), t) for t in specials if t and t in tail]
        if not found:
            raise UserError(f"chat template {self.name} ends an assistant turn with no token of the tokenizer's own")
        return min(found)[2]

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        return self.ids(messages, tools, True)

    def after_turn(self, window: list[dict], messages: list[dict], tools: list[dict] | None) -> list[int]:
        head = self.ids(window[:-1], tools, True)
        full = self.ids(window + messages, tools, True)
        if full[: len(head)] != head:
            raise NotAppendOnly(f"the ids of the first {len(head)} tokens changed when messages were appended")
        try:
            end = full.index(self.end_id, len(head))
        except ValueError:
            raise NotAppendOnly(f"the template wrote no {self.end_text!r} after the assistant turn") from None
        return full[end + 1 :]

    def count(self, messages: list[dict]) -> int:
        if not messages:
            return 0
        return len(self.ids([{"role": "system", "content": "."}] + messages, None, False)) - self._base

    def turn_text(self, generated: str) -> str:
        cut = [generated.find(t) for t in self.stop_texts if t in generated]
        return generated[: min(cut)] if cut else generated

    def parse(self, text: str) -> AssistantTurn:
        return self._parse(text)

    def assistant_text(self, window: list[dict], message: dict, tools: list[dict] | None) -> str:
        head = self.text(window, tools, True)
        full = self.text(window + [message, PLACEHOLDER], tools, True)
        if not full.startswith(head):
            raise NotAppendOnly("the text before the assistant turn changed when it was appended")
        end = full.find(self.end_text, len(head))
        if end < 0:
            raise NotAppendOnly(f"the template wrote no {self.end_text!r} after the assistant turn")
        return full[len(head) : end + len(self.end_text)]

    def assistant_ids(self, window: list[dict], message: dict, tools: list[dict] | None) -> list[int]:
        """`assistant_text` as token ids, control-token spellings in its content sanitized as in every
        other message: the turn's slice of the conversation tokenized whole (the same ids, for a
        template that passed the append-only check, as the turn's text tokenized alone)."""
        head = self.ids(window, tools, True)
        full = self.ids(window + [message, PLACEHOLDER], tools, True)
        if full[: len(head)] != head:
            raise NotAppendOnly("the ids before the assistant turn changed when it was appended")
        try:
            end = full.index(self.end_id, len(head))
        except ValueError:
            raise NotAppendOnly(f"the template wrote no {self.end_text!r} after the assistant turn") from None
        return full[len(head) : end + 1]

    def assistant_message(self, window: list[dict], text: str, turn: AssistantTurn, tools: list[dict] | None) -> dict:
        message = canonical_message(turn)
        try:
            same = self.assistant_text(window, message, tools) == text + self.end_text
        except NotAppendOnly:
            same = False
        return message if same else {"role": "assistant", "content": text}


def parse_llama3_json(text: str) -> AssistantTurn:
    """Llama 3.1+ custom tool calls: the whole reply is one JSON object
    `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`); any other reply is content."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return AssistantTurn(content=text.strip())
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return AssistantTurn("", errors=[f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body[:200]}"])
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return AssistantTurn("", errors=['tool call must be a JSON object {"name": ..., "parameters": {...}}'])
    args = obj.get("parameters", obj.get("arguments", {}))
    if not isinstance(args, dict):
        return AssistantTurn("", errors=[f"parameters of tool {obj['name']!r} must be a JSON object"])
    return AssistantTurn("", [ToolCall(obj["name"], args, "call_0")])


parse_llama3_json.parallel_calls = False  # Llama's template renders one call per assistant turn


def parse_content(text: str) -> AssistantTurn:
    """A template that teaches no tool-call syntax (SmolLM2's): every reply is content."""
    return AssistantTurn(content=text.strip())
