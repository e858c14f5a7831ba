"""The chat format: OpenAI-style messages (system/user/assistant/tool, with tool calls) to text,
and generated assistant text back to content + tool calls.

One format, two renderers that agree character for character (a test checks it): `render` here,
which the harness uses piece by piece so token ids are never re-tokenized, and `CHAT_TEMPLATE`,
the Jinja twin saved with the tokenizer so plain `AutoTokenizer.apply_chat_template` works.

    <|im_start|>system\n{system}\n\n# Tools\n{one signature per line}<|im_end|>\n
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n{content}<tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n
    <|im_start|>tool\n{content}<|im_end|>\n

A generated assistant turn ends with `<|im_end|>` (the stop token, which the policy learns to
emit); the "\n" after it belongs to the separator the harness appends.

A tool is listed as one signature line, `name(arg: type, optional?: type) - description`, rather
than its whole JSON schema: the same information in about a third of the tokens, which every
prompt, rollout and training step pays for.

`StropFormat` is this format as the harness's chat format (`strop.env.harness.chat_formats`): token ids piece
by piece, so nothing is ever re-tokenized; `strop.data.chat_template` is the other kind, a base
model's own Jinja template. Both answer the same calls.
"""

import json
import re
from dataclasses import dataclass, field
from typing import Any

from strop.errors import UserError

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
EOS, PAD = "<|endoftext|>", "<|pad|>"
SPECIAL_TOKENS = [EOS, PAD, IM_START, IM_END, TOOL_CALL, TOOL_CALL_END]
GENERATION_PROMPT = f"{IM_START}assistant\n"

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first and tools %}"
    "{% if m.role == 'system' %}<|im_start|>system\n{{ m.content }}\n\n# Tools\n"
    "{% else %}<|im_start|>system\n# Tools\n{% endif %}"
    "{% for t in tools %}{% set f = t.function if t.function is defined else t %}"
    "{% set p = f.parameters if f.parameters is defined else {} %}"
    "{% set req = p.required if p.required is defined else [] %}"
    "{{ f.name }}("
    "{% for k, v in (p.properties.items() if p.properties is defined else []) %}"
    "{% if not loop.first %}, {% endif %}{{ k }}{% if k not in req %}?{% endif %}: {{ v.type }}"
    "{% endfor %}) - {{ f.description if f.description is defined else '' }}\n{% endfor %}"
    "<|im_end|>\n"
    "{% if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in (m.tool_calls or []) %}"
    "<tool_call>{{ {'name': (c.function or c).name, 'arguments': (c.function or c).arguments} | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] | str  # a str only when the model's JSON did not parse
    id: str = ""

    def to_openai(self) -> dict:
        args = self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}


@dataclass
class AssistantTurn:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # malformed tool-call blocks, reported to the model


def _tool_call_json(call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # render what the model wrote; the harness reports the error to it
    return json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False)


def tool_signature(tool: dict) -> str:
    """`name(arg: type, optional?: type) - description` for an OpenAI function-calling schema."""
    fn = tool.get("function", tool)
    params = fn.get("parameters", {})
    required = params.get("required", [])
    args = ", ".join(
        f"{k}{'' if k in required else '?'}: {v.get('type')}" for k, v in params.get("properties", {}).items()
    )
    return f"{fn['name']}({args}) - {fn.get('description', '')}"


# The renderers below build their text from pieces: (text, given), where `given` marks text that
# comes from a message or a tool schema rather than from the format itself. `encode_pieces` tokenizes
# given text that spells a special token as plain text, so a message cannot forge the chat structure.
Pieces = list[tuple[str, bool]]


def _system_pieces(tools: list[dict] | None, system: str | None) -> Pieces:
    if not tools:
        return [(f"{IM_START}system\n", False), (system or "", True), (f"{IM_END}\n", False)]
    head = [(system, True), ("\n\n# Tools\n", False)] if system is not None else [("# Tools\n", False)]
    lines = [piece for t in tools for piece in ((tool_signature(t), True), ("\n", False))]
    return [(f"{IM_START}system\n", False), *head, *lines, (f"{IM_END}\n", False)]


def _message_pieces(message: dict) -> Pieces:
    role, content = message["role"], message.get("content") or ""
    if role == "assistant":
        calls = [
            piece
            for c in message.get("tool_calls") or []
            for piece in ((TOOL_CALL, False), (_tool_call_json(c), True), (TOOL_CALL_END, False))
        ]
        return [(f"{IM_START}assistant\n", False), (content, True), *calls, (f"{IM_END}\n", False)]
    return [(f"{IM_START}{role}\n", False), (content, True), (f"{IM_END}\n", False)]


def _chat_pieces(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> Pieces:
    out: Pieces = []
    for i, m in enumerate(messages):
        if i == 0 and tools:
            out += _system_pieces(tools, m.get("content") if m["role"] == "system" else None)
            if m["role"] != "system":
                out += _message_pieces(m)
        elif m["role"] == "system":
            out += _system_pieces(None, m.get("content"))
        else:
            out += _message_pieces(m)
    return out + ([(GENERATION_PROMPT, False)] if add_generation_prompt else [])


def render_system(tools: list[dict] | None, system: str | None) -> str:
    """The system block; with tools it lists one signature per tool."""
    return "".join(text for text, _ in _system_pieces(tools, system))


def render_message(message: dict) -> str:
    """One non-system message, including its trailing separator."""
    return "".join(text for text, _ in _message_pieces(message))


def render(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False) -> str:
    """Messages (OpenAI format) to the exact text the policy reads."""
    return "".join(text for text, _ in _chat_pieces(messages, tools, add_generation_prompt))


def encode_pieces(tokenizer, pieces: Pieces) -> list[int]:
    """The pieces' text as token ids, given text that spells a special token ("<|im_end|>" in a file
    the agent read, in a served caller's message) tokenized as plain text; the rest is tokenized
    as one text, so a message without such spellings gets the ids of its rendered text."""
    ids, pending = [], ""
    for text, given in pieces:
        if given and any(s in text for s in SPECIAL_TOKENS):
            ids += tokenizer.encode(pending, add_special_tokens=False) if pending else []
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            pending = ""
        else:
            pending += text
    return ids + (tokenizer.encode(pending, add_special_tokens=False) if pending else [])


def encode_message(tokenizer, message: dict) -> list[int]:
    """`render_message(message)` as token ids, special-token spellings in its content and tool calls
    tokenized as plain text (`encode_pieces`)."""
    return encode_pieces(tokenizer, _message_pieces(message))


def encode_chat(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False
) -> list[int]:
    """`render(...)` as token ids, special-token spellings in every message and tool schema tokenized
    as plain text (`encode_pieces`): the server's prompts, whose every message comes from a caller."""
    return encode_pieces(tokenizer, _chat_pieces(messages, tools, add_generation_prompt))


_CALL_RE = re.compile(re.escape(TOOL_CALL) + r"(.*?)(" + re.escape(TOOL_CALL_END) + r"|$)", re.S)


def parse_assistant(text: str) -> AssistantTurn:
    """Generated text (up to, not including, <|im_end|>) to content and tool calls. Never raises:
    malformed calls are kept as errors so the harness can tell the model what went wrong."""
    text = text.split(IM_END, 1)[0]
    first = text.find(TOOL_CALL)
    content = text if first < 0 else text[:first]
    turn = AssistantTurn(content=content.strip())
    for i, m in enumerate(_CALL_RE.finditer(text, max(first, 0)) if first >= 0 else []):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            turn.errors.append("tool call is missing its closing </tool_call> tag")
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            turn.errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body[:200]}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            turn.errors.append('tool call must be a JSON object {"name": ..., "arguments": {...}}')
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            turn.errors.append(f"arguments of tool {obj['name']!r} must be a JSON object")
            continue
        turn.tool_calls.append(ToolCall(name=obj["name"], arguments=args, id=f"call_{i}"))
    return turn


class StropFormat:
    """strop's format over a tokenizer, as the harness's chat format. Text inside messages that spells
    a special token ("<|im_end|>" in a file the agent read) is tokenized as plain text, so an
    observation cannot forge the chat structure."""

    parallel_calls = True  # an assistant turn may hold several tool calls
    thinking = False  # no reasoning block of its own
    end_text = IM_END  # ends every assistant turn
    name = "strop"

    def __init__(self, tokenizer):
        missing = [t for t in SPECIAL_TOKENS if len(tokenizer.encode(t, add_special_tokens=False)) != 1]
        if missing:
            raise UserError(
                f"the tokenizer has no single token for {missing[0]!r}: strop's chat format needs its special "
                'tokens; for a base model with its own chat template set harness.chat_template = "auto"'
            )
        self.tokenizer = tokenizer
        self.stop_texts = (IM_END, EOS)
        self.stop_ids = tuple(tokenizer.convert_tokens_to_ids(t) for t in self.stop_texts)
        self._generation_prompt = self.encode(GENERATION_PROMPT)
        self.generation_prompt_tokens = len(self._generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_message(self, message: dict) -> list[int]:
        """`render_message(message)` as token ids, with special-token spellings inside its content and
        tool calls tokenized as plain text (the module's `encode_message`, which the server uses too)."""
        return encode_message(self.tokenizer, message)

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """A context window rendered from `messages` (system first), ending in the generation prompt;
        special-token spellings in any message (the system's too) tokenized as plain text."""
        assert messages and messages[0]["role"] == "system", "a context window starts with the system message"
        ids = encode_pieces(self.tokenizer, _system_pieces(tools, messages[0]["content"]))
        for m in messages[1:]:
            ids += self.encode_message(m)
        return ids + self._generation_prompt

    def after_turn(self, window: list[dict], messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The forced ids after the generated assistant turn that ends `window`: the separator that
        closes it, `messages` (observations, a summary request) and the generation prompt."""
        return self.encode("\n") + [i for m in messages for i in self.encode_message(m)] + self._generation_prompt

    def count(self, messages: list[dict]) -> int:
        """Tokens `messages` take in a window."""
        return sum(len(self.encode_message(m)) for m in messages)

    def turn_text(self, generated: str) -> str:
        """A generated turn's text up to (not including) its end token."""
        return generated.split(IM_END, 1)[0]

    def parse(self, text: str) -> AssistantTurn:
        return parse_assistant(text.split(EOS, 1)[0])

    def assistant_text(self, window: list[dict], message: dict, tools: list[dict] | None) -> str:
        """The text a policy generates for `message` after `window`, up to and including the end token."""
        return render_message(message).removeprefix(GENERATION_PROMPT).removesuffix("\n")

    def assistant_ids(self, window: list[dict], message: dict, tools: list[dict] | None) -> list[int]:
        """`assistant_text` as token ids, special-token spellings inside its content and tool calls
        tokenized as plain text: a turn given as data (a logged session) trains as what it says, never
        as a forged end of turn."""
        pieces = _message_pieces(message)[1:-1] + [(IM_END, False)]
        return encode_pieces(self.tokenizer, pieces)

    def assistant_message(self, window: list[dict], text: str, turn: AssistantTurn, tools: list[dict] | None) -> dict:
        """The message stored for generated `text` (parsed as `turn`): the parsed OpenAI form when it
        renders back to exactly `text`; else the text as it was generated (spacing, malformed calls),
        so that a window's messages still render to its tokens."""
        message = canonical_message(turn)
        same = self.assistant_text(window, message, tools) == text + self.end_text
        return message if same else {"role": "assistant", "content": text}

    def text(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return render(messages, tools, add_generation_prompt)

    def ids(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
        """The whole conversation rendered at once and tokenized (what the invariant check compares with)."""
        return self.encode(self.text(messages, tools, add_generation_prompt))


def canonical_message(turn: AssistantTurn) -> dict:
    """A parsed assistant turn as an OpenAI message."""
    message = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in turn.tool_calls]
    return message
