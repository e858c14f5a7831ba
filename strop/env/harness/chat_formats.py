"""Which chat format a harness speaks, and the token-in-token-out check it runs before the first turn.

`chat_format(tokenizer, chat_template, tool_parser)`: strop's own format (`strop.data.chat`) for
strop's tiny models — a tokenizer whose template is strop's, or none — and otherwise the checkpoint's
own Jinja template (`strop.data.chat_template`), or a template file, with the parser of its tool-call
syntax (an entry point of `strop.tool_parsers` or a dotted path; "auto" tells Hermes-style
`<tool_call>` blocks and Llama's JSON replies apart from the template's text, and reads every reply
of a template with neither as content: `none`). A template that renders no tools leaves a model
answering in prose; `examples/smol/chatml_tools.jinja` is ChatML with strop's tool list and Hermes
calls, for ChatML models such as SmolLM2-Instruct.

`check_append_only` plays a scripted episode through the format the way the harness does — a prompt,
then per turn the policy's tokens and the forced tokens after them (observations, a summary request),
then context resets into new windows under the configured strategy — and refuses the format (one
line, `UserError`) when

- appending to the conversation changes how an earlier turn renders (Qwen3's template drops the
  reasoning of turns before the last user message, so a summary request rewrites them), naming the
  rewritten turn; or
- the ids built turn by turn differ from rendering the window whole, naming the turn where they
  first diverge.

RL trains on the ids the policy generated and the harness appended, never re-tokenized; a template
failing either check would make those differ from what the same conversation renders to in
production (`strop serve`) or in SFT on logged sessions.
"""

import json
from pathlib import Path

from strop.data.chat import CHAT_TEMPLATE, StropFormat
from strop.data.chat_template import NotAppendOnly, TemplateFormat
from strop.env.harness.context import SUMMARY_REQUEST, carry, summary_state
from strop.env.plugins import load_object
from strop.errors import UserError

PARSERS = "strop.tool_parsers"  # the entry point group tool-call parsers register under
Window = tuple[list[dict], list[tuple[dict, list[dict]]]]  # opening messages; (assistant turn, what follows it)


def chat_format(tokenizer, chat_template: str = "auto", tool_parser: str = "auto"):
    """The chat format of a harness: `StropFormat` or `TemplateFormat` (see the module docstring)."""
    if chat_template == "strop":
        return StropFormat(tokenizer)
    if chat_template == "auto":
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        if not template or template == CHAT_TEMPLATE:
            return StropFormat(tokenizer)
        name = "of the checkpoint"
    else:
        path = Path(chat_template)
        if not path.is_file():
            raise UserError(f"harness.chat_template {chat_template!r}: no such file (or 'auto', 'strop')")
        template, name = path.read_text(encoding="utf-8"), path.name
    return TemplateFormat(tokenizer, template, _parser(tool_parser, template, name), name)


def _parser(spec: str, template: str, name: str):
    if spec == "auto":
        if "<tool_call>" in template:
            spec = "hermes"
        elif '"parameters"' in template:
            spec = "llama3_json"
        else:  # a template without tool syntax (SmolLM2-Instruct's): replies are content
            spec = "none"
    return load_parser(spec)


def load_parser(spec: str):
    """The tool-call parser `spec` names: an entry point of `strop.tool_parsers` or a dotted path."""
    parser = load_object(PARSERS, spec, "tool parser")
    if parser is None or not callable(parser):
        raise UserError(f"unknown tool parser {spec!r}: not an entry point of {PARSERS} or a dotted path to a function")
    return parser


# ---- the scripted episode ----------------------------------------------------------------------


def _example(spec: dict):
    kind = spec.get("type") if isinstance(spec, dict) else None
    return {"integer": 2, "number": 1.5, "boolean": True, "array": ["a"], "object": {"k": "v"}}.get(kind, "mod.py")


def _call(i: int, schema: dict) -> dict:
    fn = schema["function"]
    required = fn["parameters"].get("required", [])
    args = {k: _example(v) for k, v in fn["parameters"].get("properties", {}).items() if k in required}
    return {"id": f"call_{i}", "type": "function", "function": {"name": fn["name"], "arguments": json.dumps(args)}}


def _obs(i: int, text: str) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": text}


def probe_windows(fmt, tools: list[dict], system: str, strategy: str) -> list[Window]:
    """A short episode as the harness would play it with this format, tool set and context strategy."""
    think = "<think>\nThe test fails; I should read the code first.\n</think>\n\n" if fmt.thinking else ""
    pick = [tools[i % len(tools)] for i in range(4)]
    head = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the bug in mod.py."}]
    first = [
        (
            {"role": "assistant", "content": think + "Let me look.", "tool_calls": [_call(0, pick[0])]},
            [_obs(0, "1| def add(a, b):\n2|     return a - b")],
        ),
        (
            {
                "role": "assistant",
                "content": think.replace("read the code", "check") + "Two more.",
                "tool_calls": [_call(1, pick[1])] + ([_call(2, pick[2])] if fmt.parallel_calls else []),
            },
            [_obs(1, "exit code 1\nFAILED test_add")] + ([_obs(2, "ok")] if fmt.parallel_calls else []),
        ),
        (
            {
                "role": "assistant",
                "content": think.replace("read", "edit") + "Now the fix.",
                "tool_calls": [_call(3, pick[3])],
            },
            [_obs(3, "edited mod.py (line 2)")],
        ),
    ]
    windows: list[Window] = [(head, first)]
    if strategy == "none":
        return windows
    history = [m for asst, after in first for m in [asst, *after]]
    if strategy == "summarize":
        summary = "The bug was in add (mod.py line 2); I fixed it. Left: run the tests."
        asst, after = first[-1]
        first[-1] = (asst, after + [{"role": "user", "content": SUMMARY_REQUEST}])
        first.append(({"role": "assistant", "content": think + summary}, []))
        carried = summary_state(summary, history, 0, 10_000, fmt.count)
    else:
        carried = carry(strategy, history, [], 1, 10_000, fmt.count)
    done = {"role": "assistant", "content": think + "Done.", "tool_calls": [_call(5, pick[0])]}
    second = [
        ({"role": "assistant", "content": think + "Tests next.", "tool_calls": [_call(4, pick[1])]}, [_obs(4, "ok")]),
        (done, [_obs(5, "submitted")]),
    ]
    return windows + [(head + carried, second)]


# ---- the check ----------------------------------------------------------------------------------


def _rewritten(fmt, window: list[dict], grown: list[dict], tools: list[dict]) -> str:
    """Which message of `window` renders differently in `grown`, and how."""
    old, new = fmt.text(window, tools, True), fmt.text(grown, tools, True)
    at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    index = 0  # the message whose rendering holds the first changed character
    for j in range(1, len(window)):
        try:
            if len(fmt.text(window[:j], tools, False)) <= at:
                index = j
        except UserError:  # a template may refuse a partial conversation (no user message yet)
            continue
    role = window[index]["role"]
    turn = sum(m["role"] == "assistant" for m in window[: index + 1])
    what = f"assistant turn {turn}" if role == "assistant" else f"message {index + 1} ({role})"
    return f"{what} {old[at : at + 40]!r} became {new[at : at + 40]!r}"


def _appended(after: list[dict]) -> str:
    if after and after[-1]["content"] == SUMMARY_REQUEST:
        return "the summary request"
    return f"{len(after)} tool result(s)"


def check_append_only(fmt, tools: list[dict], windows: list[Window]) -> None:
    """Refuse `fmt` (`UserError`, one line) when the scripted `windows` do not render append-only, or
    their turn-by-turn ids differ from the whole window's."""
    for w, (opening, played) in enumerate(windows, 1):
        where_w = f" of context window {w}" if len(windows) > 1 else ""
        window = [dict(m) for m in opening]
        pieces = [(fmt.prompt(window, tools), f"the prompt{where_w}")]
        for k, (assistant, after) in enumerate(played, 1):
            where = f"assistant turn {k}{where_w}"
            try:
                text = fmt.assistant_text(window, assistant, tools)
            except NotAppendOnly:
                raise UserError(
                    f"chat template {fmt.name} is not append-only: {where} rewrites the conversation before it "
                    f"({_rewritten(fmt, window, window + [assistant], tools)})"
                ) from None
            pieces.append((fmt.tokenizer.encode(text, add_special_tokens=False), where))
            window.append(assistant)
            if not after:
                continue
            try:
                pieces.append((fmt.after_turn(window, after, tools), f"what follows {where}"))
            except NotAppendOnly:
                if fmt.text(window + after, tools, True).startswith(fmt.text(window[:-1], tools, True)):
                    # the text grew at its end, but tokenized whole its ids before the turn changed
                    head, grown = fmt.ids(window[:-1], tools, True), fmt.ids(window + after, tools, True)
                    _diverged(fmt, [(head, f"the prompt before {where}")], grown[: len(head)])
                raise UserError(
                    f"chat template {fmt.name} is not append-only: appending {_appended(after)} after {where} "
                    f"rewrites {_rewritten(fmt, window[:-1], window + after, tools)}; token-in-token-out training "
                    "needs a template that never changes earlier turns"
                ) from None
            window += after
        ends_open = bool(played and played[-1][1])
        whole = fmt.ids(window if ends_open else window + [{"role": "tool", "content": ""}], tools, ends_open)
        got = [i for ids, _ in pieces for i in ids]
        _diverged(fmt, pieces, whole if ends_open else whole[: len(got)])


def _diverged(fmt, pieces: list[tuple[list[int], str]], whole: list[int]) -> None:
    """Refuse `fmt` when the ids of `pieces`, joined, differ from `whole`, naming the piece where."""
    got = [i for ids, _ in pieces for i in ids]
    if got == whole:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, whole)) if a != b), min(len(got), len(whole)))
    start, where = 0, "the end"
    for n, (ids, label) in enumerate(pieces):
        if at < start + len(ids):
            last = at == start + len(ids) - 1 and n + 1 < len(pieces)  # a merge across the boundary
            where = f"the end of {label}, before {pieces[n + 1][1]}" if last else label
            break
        start += len(ids)
    shown = [fmt.tokenizer.decode(x[at : at + 1], skip_special_tokens=False) for x in (got, whole)]
    raise UserError(
        f"chat template {fmt.name}: ids built turn by turn diverge from the whole window's at token {at}, "
        f"in {where} ({shown[0]!r} vs {shown[1]!r})"
    )
