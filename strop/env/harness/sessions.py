"""Product sessions as warm-start data: what `strop agent --log-session` and `strop serve --log-sessions`
append, one OpenAI-format chat conversation with tool calls a JSONL line — the format `sft.traces`
reads (`strop.train.traces`):

    {"messages": [system, user, assistant (tool_calls), tool, ..., assistant], "tools": [schemas], ...}

An agent episode gives one line per context window (a window is what the policy saw at once; after
a reset the next opens from system + task + carried state), each cut after its last assistant turn:
the observations after it carry no loss. A served chat completion gives one line per choice: the
request's messages and the reply. Other keys (`session`) are metadata the reader ignores.
"""

import json
import threading
from pathlib import Path

from strop.data.chat import canonical_message, parse_assistant
from strop.env.episode import Episode

_LOCK = threading.Lock()  # one writer at a time: served requests finish on several threads


def episode_conversations(episode: Episode, tools: list[dict], meta: dict | None = None) -> list[dict]:
    """One conversation per context window of `episode` that holds an assistant turn."""
    out = []
    for i, segment in enumerate(episode.segments):
        messages = list(segment.messages)
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        if messages:
            session = {"window": i, "windows": len(episode.segments), "stop_reason": episode.stop_reason}
            out.append({"messages": messages, "tools": tools, "session": session | (meta or {})})
    return out


def served_conversations(request: dict, texts: list[str]) -> list[dict]:
    """One conversation per choice of a served chat completion (strop's chat format)."""
    messages = list(request.get("messages") or [])
    return [
        {"messages": messages + [canonical_message(parse_assistant(t))], "tools": request.get("tools") or []}
        for t in texts
    ]


def append_conversations(path: str | Path, conversations: list[dict]) -> None:
    """Append whole lines in one write: a crash loses at most the lines being written."""
    if not conversations:
        return
    data = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations)
    with _LOCK, open(path, "a", encoding="utf-8") as f:
        f.write(data)
        f.flush()
