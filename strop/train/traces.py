"""Logged product sessions as SFT data: JSONL of OpenAI-format chat conversations with tool calls
(what products log, and what `strop agent --log-session` writes), one conversation a line:

    {"messages": [{"role": "system", "content": ...}, {"role": "user", "content": ...},
                  {"role": "assistant", "content": ..., "tool_calls": [{"type": "function",
                   "function": {"name": "read_file", "arguments": "{\\"path\\": \\"a.py\\"}"}}]},
                  {"role": "tool", "tool_call_id": ..., "content": ...}, ..., {"role": "assistant", ...}]}

Each line is checked before anything trains (`UserError` naming the file, the line and what is wrong:
not JSON, an unknown role, a tool call to a tool the run's harness does not declare, arguments that
are not a JSON object, no final assistant turn). A conversation is rendered through the run's
harness — its tool set, and its chat format (strop's or the checkpoint's template) — into one
`Segment`: every assistant turn as the policy would generate it (loss_mask 1), everything else forced
(loss_mask 0). A conversation without a system message gets the harness's. Text in any message,
assistant turns included, that spells a control token (`<|im_end|>`) is tokenized as plain text, as
the serving path tokenizes a caller's messages: a logged line cannot forge a turn's end or a system
message into training.
"""

import json
from pathlib import Path

from strop.env.episode import Segment
from strop.errors import UserError
from strop.jsonl import TOO_LONG, read_records

ROLES = ("system", "user", "assistant", "tool")


def _content(value, where: str) -> str:
    """Message content: a string, null, or OpenAI's list of text parts."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise UserError(f"{where}: content must be a string or a list of text parts")


def _tool_call(call, declared: list[str], where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise UserError(
            f'{where}: a tool call must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}'
        )
    if fn["name"] not in declared:
        raise UserError(f"{where}: tool call to undeclared tool {fn['name']!r} (declared: {', '.join(declared)})")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: arguments of {fn['name']!r} are not JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise UserError(f"{where}: arguments of {fn['name']!r} must be a JSON object")
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def parse_conversation(obj, declared: list[str], where: str) -> list[dict]:
    """One logged conversation, checked and normalized (string contents, JSON-string arguments)."""
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: expected an object {{"messages": [...]}} with at least one message')
    out = []
    for i, m in enumerate(messages):
        at = f"{where}, message {i + 1}"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise UserError(
                f"{at}: role must be one of {', '.join(ROLES)}, got {m.get('role') if isinstance(m, dict) else m!r}"
            )
        if m["role"] == "system" and i:
            raise UserError(f"{at}: a system message must come first")
        msg = {"role": m["role"], "content": _content(m.get("content"), at)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise UserError(f"{at}: tool_calls must be a list")
            msg["tool_calls"] = [_tool_call(c, declared, at) for c in m["tool_calls"]]
        if m["role"] == "tool":
            if not out or out[-1]["role"] not in ("assistant", "tool"):
                raise UserError(f"{at}: a tool result must follow an assistant turn")
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        out.append(msg)
    if out[-1]["role"] != "assistant":
        raise UserError(
            f"{where}: the conversation has no final assistant turn (it ends with a {out[-1]['role']} message)"
        )
    if all(
        m["role"] in ("system", "assistant")
        for m in out[: next(i for i, m in enumerate(out) if m["role"] == "assistant")]
    ):
        raise UserError(f"{where}: the first assistant turn answers no user message")
    return out


def read_traces(path: str | Path, declared: list[str]) -> list[list[dict]]:
    """Every conversation of a trace file, checked line by line (blank lines are skipped)."""
    out = [parse_conversation(obj, declared, where) for where, obj in read_records(path, "sft.traces")]
    if not out:
        raise UserError(f"sft.traces {str(path)!r} holds no conversation")
    return out


def render_conversation(harness, messages: list[dict]) -> Segment:
    """One conversation as the harness's chat format renders it: the assistant turns as generated
    tokens (loss_mask 1), the rest forced."""
    fmt, tools = harness.format, harness.schemas
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": harness.config.system}] + messages
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    window = messages[:first]
    seg = Segment(messages=[dict(m) for m in messages])
    seg.add_forced(fmt.prompt(window, tools))
    i = first
    while i < len(messages):
        assistant = messages[i]
        ids = fmt.assistant_ids(window, assistant, tools)  # a forged control token in it stays text
        seg.add_generated(ids, [0.0] * len(ids), [0] * len(ids), None)
        window = window + [assistant]
        j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
        if j > i + 1:
            seg.add_forced(fmt.after_turn(window, messages[i + 1 : j], tools))
            window = window + messages[i + 1 : j]
        i = j
    return seg


# characters of a logged line per token of its rendering, at most: a line past max_len times this
# (and the tool schemas' room) cannot fit the model, and is skipped without being read whole
CHARS_PER_TOKEN = 64
SCHEMA_ROOM = 1 << 20


def trace_segments(harness, path: str | Path, max_len: int, max_traces: int) -> tuple[list[Segment], dict]:
    """(the segments of the trace file's first `max_traces` conversations that fit in `max_len` tokens,
    {"traces_too_long": how many did not, "traces_unread": whether the file held more}), read a line
    at a time: memory holds what trains, never the file."""
    kept, too_long = [], 0
    records = read_records(path, "sft.traces", max_chars=CHARS_PER_TOKEN * max_len + SCHEMA_ROOM)
    for where, obj in records:
        if len(kept) + too_long == max_traces:
            print(f"[sft] sft.traces: read the first {max_traces} conversations (sft.max_traces)", flush=True)
            return _checked(kept, path, max_len), {"traces_too_long": too_long, "traces_unread": True}
        if obj is TOO_LONG:
            too_long += 1
            continue
        segment = render_conversation(harness, parse_conversation(obj, harness.tools.names, where))
        if len(segment) <= max_len:
            kept.append(segment)
        else:
            too_long += 1
    if not kept and not too_long:
        raise UserError(f"sft.traces {str(path)!r} holds no conversation")
    return _checked(kept, path, max_len), {"traces_too_long": too_long, "traces_unread": False}


def _checked(kept: list[Segment], path: str | Path, max_len: int) -> list[Segment]:
    if not kept:
        raise UserError(f"sft.traces {str(path)!r}: every conversation is longer than the model's {max_len} tokens")
    return kept
