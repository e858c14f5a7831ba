"""Product sessions as warm-start data: what `strop agent --log-session` and `strop serve --log-sessions`
append, one OpenAI-format chat conversation with tool calls a JSONL line — the format `sft.traces`
reads (`strop.train.traces`):

    {"messages": [system, user, assistant (tool_calls), tool (tool_call_id), ..., assistant],
     "tools": [schemas], ...}

Tool calls are OpenAI's `tool_calls` fields (each with an id unique in the conversation, which the
`tool` messages after it answer in `tool_call_id`), whatever chat format the policy spoke: a turn the
policy wrote in other than the format's canonical spelling (spacing, key order) is logged as what
the format parsed from it. Only a call that did not parse stays as the text that was generated, and
the error the harness answered it with is a `tool` message without a `tool_call_id`.

An agent episode gives one line per context window (a window is what the policy saw at once; after
a reset the next opens from system + task + carried state), each cut after its last assistant turn:
the observations after it carry no loss. A served chat completion gives one line per choice: the
request's messages and the reply. Other keys (`session`) are metadata the reader ignores. A log is
appended to, never written through a symbolic link (`strop.confined.open_append`).
"""

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from strop.confined import open_append
from strop.data.chat import AssistantTurn, canonical_message, parse_assistant
from strop.env.episode import Episode

_LOCK = threading.Lock()  # one writer at a time: served requests finish on several threads


def _openai_messages(messages: list[dict], parse: Callable[[str], AssistantTurn], n: int = 0) -> list[dict]:
    """`messages` with every assistant turn's tool calls as `tool_calls` (parsed by `parse` where the
    turn was stored as the text generated), their ids numbered from `n` on, unique in the conversation."""
    out: list[dict] = []
    ids: dict[str, str] = {}  # the latest assistant turn's call ids -> the conversation's
    for m in messages:
        if m["role"] == "assistant":
            if "tool_calls" not in m:
                turn = parse(m.get("content") or "")
                m = canonical_message(turn) if turn.tool_calls and not turn.errors else m
            ids = {}
            for call in m.get("tool_calls") or []:
                ids[call["id"]], n = f"call_{n}", n + 1
            if ids:
                m = {**m, "tool_calls": [{**c, "id": ids[c["id"]]} for c in m["tool_calls"]]}
        elif m["role"] == "tool" and "tool_call_id" in m:
            m = {**m, "tool_call_id": ids.get(m["tool_call_id"], m["tool_call_id"])}
        out.append(m)
    return out


def episode_conversations(episode: Episode, harness, meta: dict | None = None) -> list[dict]:
    """One conversation per context window of `episode` that holds an assistant turn, its tool calls
    read by `harness`'s chat format (`Harness`: its `format.parse` and tool `schemas`)."""
    out = []
    for i, segment in enumerate(episode.segments):
        messages = list(segment.messages)
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        if messages:
            session = {"window": i, "windows": len(episode.segments), "stop_reason": episode.stop_reason}
            logged = _openai_messages(messages, harness.format.parse)
            out.append({"messages": logged, "tools": harness.schemas, "session": session | (meta or {})})
    return out


def served_conversations(request: dict, texts: list[str]) -> list[dict]:
    """One conversation per choice of a served chat completion (strop's chat format)."""
    messages = list(request.get("messages") or [])  # the caller's, as sent
    calls = sum(len(m.get("tool_calls") or []) for m in messages)
    return [
        {
            "messages": messages + _openai_messages([canonical_message(parse_assistant(t))], parse_assistant, calls),
            "tools": request.get("tools") or [],
        }
        for t in texts
    ]


def check_log(path: str | Path, what: str) -> None:
    """UserError now, in one line, when `path` cannot take a session log (`open_append`): a command
    says so at its start, not after its work, nor on every request."""
    os.close(open_append(path, what))


def append_conversations(path: str | Path, conversations: list[dict], what: str = "session log") -> None:
    """Append whole lines in one write: a crash loses at most the lines being written."""
    if not conversations:
        return
    data = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations).encode()
    with _LOCK, os.fdopen(open_append(path, what), "ab") as f:
        f.write(data)
