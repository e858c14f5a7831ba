"""Context strategies: what an episode carries into its next context window when the current one is full.

The harness (`strop.env.harness.loop`) decides *when*: before a turn that would not fit in the window
(`HarnessConfig.max_context`, less the summary's room for "summarize"), up to `max_resets` times per
episode. This module decides *what*: the messages that follow the system message and the task in the
next window (the carried state). The same choice serves RL rollouts, evaluation and `strop agent`.

- `summarize` — the policy itself writes the carried state: the harness appends `SUMMARY_REQUEST` (a
  user message) to the full window and samples a reply of at most `summary_tokens` tokens, which is
  part of the trajectory like any action (loss_mask 1) and shares the episode's reward. The next
  window is system + task + `SUMMARY_HEADER` + summary (+ the last `summary_tail` turns verbatim).
  Learned summarization is this strategy after RL.
- `truncation` — drop the oldest whole turns until the rest fits.
- `masking` — replace every tool observation but the last `keep_recent` by `MASKED`, then truncate if
  that is still too long ("The Complexity Trap", 2025: a strong, cheap baseline).
- `compaction` — a heuristic note: the list of every tool call so far (one line each, the oldest
  dropped first if it must be) plus the last `keep_recent` observations in full.

`episode_context` and `context_figures` turn an episode's resets into the numbers `strop bench longctx`
and held-out evaluation report (resets, carried-state tokens, compaction error, and the summaries).

Strategies work on messages only and are given `count` (tokens of a list of messages, as the harness
renders them) and `room` (tokens the carried state may take), so the next window always has space for
a full turn.
"""

from typing import TYPE_CHECKING, Callable, Literal

from strop.env.harness.tools import describe_call

if TYPE_CHECKING:
    from strop.env.episode import Episode

Strategy = Literal["none", "summarize", "truncation", "masking", "compaction"]
STRATEGIES: tuple[str, ...] = ("none", "summarize", "truncation", "masking", "compaction")
SUMMARY_REQUEST = (
    "Your context window is full and will be reset now. Write a summary for yourself to continue "
    "from: the facts you found that later steps need (exact values and file names), what is done and "
    "what is left. Do not call tools; your summary replaces this conversation."
)
SUMMARY_HEADER = "Summary of your work before the context reset:"
MASKED = "[old tool output omitted]"
COMPACTION_HEADER = "Context reset. Tool calls so far, oldest first:"

Count = Callable[[list[dict]], int]


def turns(history: list[dict]) -> list[list[dict]]:
    """`history` (the window after system and task) cut into turns: each starts at an assistant
    message; messages before the first (an earlier carried state) form a turn of their own."""
    out: list[list[dict]] = []
    for m in history:
        if m["role"] == "assistant" or not out:
            out.append([])
        out[-1].append(m)
    return out


def truncate(history: list[dict], room: int, count: Count) -> list[dict]:
    """The most recent whole turns of `history` that fit in `room` tokens."""
    kept: list[list[dict]] = []
    for turn in reversed(turns(history)):
        if count([m for t in [turn, *kept] for m in t]) > room:
            break
        kept.insert(0, turn)
    return [m for t in kept for m in t]


def mask(history: list[dict], keep_recent: int, room: int, count: Count) -> list[dict]:
    """Every tool observation but the last `keep_recent` replaced by `MASKED`, truncated to `room`."""
    tool_at = [i for i, m in enumerate(history) if m["role"] == "tool"]
    old = set(tool_at[: max(len(tool_at) - keep_recent, 0)])
    masked = [{**m, "content": MASKED} if i in old else m for i, m in enumerate(history)]
    return truncate(masked, room, count)


def compact(tool_calls: list[dict], keep_recent: int, room: int, count: Count) -> list[dict]:
    """One user note: every call of the episode (`Episode.tool_calls`), one line each, and the last
    `keep_recent` outputs in full; the oldest lines go first when the note would not fit."""
    lines = [
        f"{i + 1}. {describe_call(c['name'], c['arguments'])}" + (" (rejected)" if c.get("error") else "")
        for i, c in enumerate(tool_calls)
    ]
    recent = [
        f"Output of {describe_call(c['name'], c['arguments'])}:\n{c['output']}"
        for c in (tool_calls[-keep_recent:] if keep_recent else [])
    ]
    while True:
        note = [{"role": "user", "content": "\n".join([COMPACTION_HEADER, *lines, "", *recent]).strip()}]
        if count(note) <= room or not (lines or recent):
            return note if count(note) <= room else []
        if lines:
            lines.pop(0)
        else:
            recent.pop(0)


def summary_state(summary: str, history: list[dict], tail_turns: int, room: int, count: Count) -> list[dict]:
    """The carried state of "summarize": the summary as a user message, then up to `tail_turns` of
    the most recent turns of `history` that still fit."""
    note = [{"role": "user", "content": f"{SUMMARY_HEADER}\n{summary}"}]
    tail = turns(history)[-tail_turns:] if tail_turns else []
    return note + truncate([m for t in tail for m in t], room - count(note), count)


def carry(
    strategy: Strategy, history: list[dict], tool_calls: list[dict], keep_recent: int, room: int, count: Count
) -> list[dict]:
    """The carried state of a message-only strategy (truncation, masking, compaction)."""
    if strategy == "truncation":
        return truncate(history, room, count)
    if strategy == "masking":
        return mask(history, keep_recent, room, count)
    assert strategy == "compaction", f"{strategy} is not a message-only strategy"
    return compact(tool_calls, keep_recent, room, count)


def reset_probe(resets: list[dict], tool_calls: list[dict], facts: list[str]) -> list[tuple[int, int]]:
    """The compaction-error probe per reset (`Episode.resets`): how many of the needed `facts` that
    tool outputs had shown before it its carried state no longer holds, and how many had been shown
    (lost, shown)."""
    probe = []
    for reset in resets:
        seen = "\n".join(str(c["output"]) for c in tool_calls[: reset["calls"]])
        carried = "\n".join(str(m.get("content") or "") for m in reset["carried"])
        shown = [f for f in facts if f in seen]
        probe.append((sum(f not in carried for f in shown), len(shown)))
    return probe


def facts_lost(resets: list[dict], tool_calls: list[dict], facts: list[str]) -> tuple[int, int]:
    """The probe over a whole episode (lost, found); the share lost is lost / found."""
    return _probe_totals(reset_probe(resets, tool_calls, facts))


def _probe_totals(probe: list[tuple[int, int]]) -> tuple[int, int]:
    return sum(lost for lost, _ in probe), sum(shown for _, shown in probe)


def episode_context(episode: "Episode", facts: list[str]) -> dict:
    """One episode's long-context record (plain data): its resets, the tokens of each carried state,
    the compaction-error probe's counts (`reset_probe`, for the task's needed `facts`), the tokens of
    all its windows, the summaries it wrote (the text after `SUMMARY_HEADER` in each carried state
    of "summarize"), and per reset how many needed facts had been shown before it."""
    resets = episode.resets
    probe = reset_probe(resets, episode.tool_calls, facts)
    lost, found = _probe_totals(probe)
    head = f"{SUMMARY_HEADER}\n"
    summaries = [
        m["content"][len(head) :]
        for r in resets
        for m in r["carried"][:1]
        if str(m.get("content") or "").startswith(head)
    ]
    return {
        "resets": len(resets),
        "carried_tokens": [r["carried_tokens"] for r in resets],
        "facts_lost": lost,
        "facts_found": found,
        "tokens": sum(len(seg) for seg in episode.segments),
        "summaries": summaries,
        "facts_shown": [shown for _, shown in probe],
    }


def context_figures(records: list[dict]) -> dict:
    """Means over episodes' `episode_context` records: resets per episode (and the fewest), tokens of
    a carried state, compaction error (needed facts lost over facts shown, pooled; None when no reset
    followed a shown fact, as for a policy that never reads a stage: there is nothing to lose), the
    facts shown it is pooled over, tokens per episode."""
    n = max(len(records), 1)
    carried = [c for r in records for c in r["carried_tokens"]]
    found = sum(r["facts_found"] for r in records)
    return {
        "resets_mean": sum(r["resets"] for r in records) / n,
        "resets_min": min((r["resets"] for r in records), default=0),
        "carried_tokens_mean": sum(carried) / len(carried) if carried else 0.0,
        "compaction_error": sum(r["facts_lost"] for r in records) / found if found else None,
        "facts_found": found,
        "tokens_per_episode": sum(r["tokens"] for r in records) / n,
    }
