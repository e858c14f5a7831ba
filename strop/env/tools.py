"""The production coding toolset: OpenAI function-calling schemas and their execution inside a
sandbox.

`execute(sandbox, name, arguments)` never raises for anything the model can write: unknown tools,
missing or mistyped arguments, missing files, binary files, ambiguous edits, command timeouts and
floods all come back as a `ToolResult` whose `error` says what was wrong (the observation the
model reads starts with "error:"). Schemas and observations are kept short on purpose: a tiny
policy with a ~2k-token context pays for every byte of them. Long outputs keep their head and tail
around a "[... N chars cut ...]" marker, so pytest's summary line survives.

File tools act through the sandbox's confined host-side file API (fast, no process); `list_dir`,
`grep` and `run` execute real commands inside the sandbox, so their output looks exactly like
the production machine's.
"""

import difflib
import re
from dataclasses import dataclass

from strop.env.sandbox import Sandbox

MAX_READ_LINES = 120  # lines per read_file call when no end is given
MAX_LIST_ENTRIES = 200
MAX_GREP_LINES = 60
MAX_LINE_CHARS = 200  # a grep hit or listed line longer than this is cut
HINT_MIN_RATIO = 0.6  # an edit's old text this alike to some lines of the file gets them shown in the error
HINT_MAX_LINES = 3000  # beyond this many lines the search for them costs more than the hint is worth
RUN_TIMEOUT_S = 30.0  # default (and, times 4, the largest) timeout of the run tool
# the duration at the end of pytest's summary line: "6 passed in 0.04s", "== 1 failed in 1.20s (0:00:01) =="
_PYTEST_DURATION = re.compile(
    r"^(.*\b(?:passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?|no tests ran)\b.*?)"
    r" in \d+\.\d+s(?: \(\d+:\d\d:\d\d\))?( =+)?$",
    re.MULTILINE,
)


def _schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties} | ({"required": required} if required else {})
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


_S, _I = {"type": "string"}, {"type": "integer"}
TOOLS: list[dict] = [
    _schema("read_file", "Show lines start..end of a file, numbered.", {"path": _S, "start": _I, "end": _I}, ["path"]),
    _schema(
        "edit_file",
        "Replace exact text old (must be unique) by new.",
        {"path": _S, "old": _S, "new": _S},
        ["path", "old", "new"],
    ),
    _schema("write_file", "Create or overwrite a file.", {"path": _S, "content": _S}, ["path", "content"]),
    _schema("list_dir", "List files (2 levels).", {"path": _S}, []),
    _schema("grep", "Search files for a regex.", {"pattern": _S, "path": _S}, ["pattern"]),
    _schema("run", "Run a shell command.", {"command": _S, "timeout": _I}, ["command"]),
    _schema("submit", "Finish; your changes are final.", {}, []),
]
_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@dataclass
class ToolResult:
    output: str  # the observation the model reads
    error: str | None = None  # why the call was rejected or failed; None on success
    submitted: bool = False

    def log(self, name: str, arguments: dict | str) -> dict:
        """The hack monitor's record of this call."""
        return {"name": name, "arguments": arguments, "output": self.output, "error": self.error}


def _error(message: str) -> ToolResult:
    return ToolResult(f"error: {message}", error=message)


def clip(text: str, limit: int) -> str:
    """`text` if it fits in `limit` chars, else its head and tail around a cut marker."""
    if len(text) <= limit:
        return text
    keep = max(limit - 40, 0)
    head, tail = text[: keep // 2], text[len(text) - (keep - keep // 2) :] if keep else ""
    return f"{head}\n[... {len(text) - len(head) - len(tail)} chars cut ...]\n{tail}"


def _check_arguments(name: str, arguments: dict) -> str | None:
    """Why `arguments` do not fit the schema of `name`, or None."""
    params = _PARAMS[name]
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"{name} needs argument(s) {', '.join(missing)}"
    for key, value in arguments.items():
        spec = params["properties"].get(key)
        if spec is None:
            return f"{name} has no argument {key!r} (arguments: {', '.join(params['properties']) or 'none'})"
        want = str if spec["type"] == "string" else int
        if not isinstance(value, want) or isinstance(value, bool):
            return f"argument {key!r} of {name} must be a{'n integer' if want is int else ' string'}"
        if isinstance(value, str) and "\x00" in value:
            return f"argument {key!r} contains a NUL character"
    return None


class _Rejected(Exception):
    """A call the model got wrong (a missing file, a directory, binary data): its message is the observation."""


def _os_error(e: OSError, path: str) -> _Rejected:
    if isinstance(e, FileNotFoundError):
        return _Rejected(f"no such file: {path}")
    if isinstance(e, IsADirectoryError):
        return _Rejected(f"{path} is a directory")
    return _Rejected(f"{path}: {e.strerror or e}")  # permissions, symlink loops, not a directory


def _read_text(sb: Sandbox, path: str) -> str:
    try:
        data = sb.read_file(path)
    except OSError as e:
        raise _os_error(e, path) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _Rejected(f"{path} is not a UTF-8 text file ({len(data)} bytes)") from None


def _write_text(sb: Sandbox, path: str, text: str) -> None:
    try:
        sb.write_file(path, text)
    except OSError as e:
        raise _os_error(e, path) from None


def _read_file(sb: Sandbox, path: str, start: int = 1, end: int | None = None, *, limit: int) -> ToolResult:
    lines = _read_text(sb, path).splitlines()
    if not lines:
        return ToolResult(f"({path} is empty)")
    if start < 1 or (end is not None and end < start):
        return _error("need 1 <= start <= end")
    if start > len(lines):
        return _error(f"start={start} but {path} has {len(lines)} lines")
    stop = min(len(lines), end if end is not None else start + MAX_READ_LINES - 1)
    body = "\n".join(f"{i}| {lines[i - 1]}" for i in range(start, stop + 1))
    paged = end is None and stop < len(lines)  # the model asked for the whole file and got a page
    more = f"\n[{len(lines) - stop} more lines; read with start={stop + 1}]" if paged else ""
    return ToolResult(clip(body, limit) + more)


def _edit_file(sb: Sandbox, path: str, old: str, new: str, *, limit: int) -> ToolResult:
    if not old:
        return _error("old must not be empty (use write_file to create a file)")
    if old == new:
        return _error("old and new are the same")
    text = _read_text(sb, path)
    count = text.count(old)
    if count == 0:
        return _error(f"old text not found in {path}" + _closest_hint(text, old))
    if count > 1:
        return _error(f"old text occurs {count} times in {path}; add context to make it unique")
    at = text.index(old)
    _write_text(sb, path, text[:at] + new + text[at + len(old) :])
    first = text.count("\n", 0, at) + 1
    return ToolResult(f"edited {path} (line {first})")


def closest_lines(text: str, old: str) -> list[str]:
    """The lines of `text` most like `old` (as many lines as `old` has), numbered as read_file shows
    them, when they are alike enough to be what the model meant; else []."""
    lines = text.splitlines()
    want = old.strip("\n")
    n = want.count("\n") + 1
    if not lines or not want.strip() or n > len(lines) or len(lines) > HINT_MAX_LINES or len(want) > 4000:
        return []
    matcher = difflib.SequenceMatcher(autojunk=False)
    matcher.set_seq2(want)
    best, best_at = 0.0, 0
    for i in range(len(lines) - n + 1):
        matcher.set_seq1("\n".join(lines[i : i + n]))
        if matcher.real_quick_ratio() > best and matcher.quick_ratio() > best and (r := matcher.ratio()) > best:
            best, best_at = r, i
    if best < HINT_MIN_RATIO:
        return []
    return [f"{i + 1}| {lines[i]}" for i in range(best_at, best_at + n)]


def _closest_hint(text: str, old: str) -> str:
    """The error's "did you mean" part, as editors have it: a model that misremembered a line can
    copy it from the error instead of guessing again."""
    shown = closest_lines(text, old)
    return "; closest text:\n" + "\n".join(shown) if shown else ""


def _write_file(sb: Sandbox, path: str, content: str, *, limit: int) -> ToolResult:
    _write_text(sb, path, content)
    return ToolResult(f"wrote {path} ({len(content.splitlines())} lines)")


def _command(sb: Sandbox, argv: list[str], limit: int, max_lines: int, empty: str, ok_codes=(0,)) -> ToolResult:
    result = sb.exec(argv, timeout=RUN_TIMEOUT_S)
    if result.exit_code not in ok_codes or result.timed_out:
        return _error(clip(result.stderr.strip() or f"exit code {result.exit_code}", limit))
    lines = [l if len(l) <= MAX_LINE_CHARS else l[:MAX_LINE_CHARS] + "..." for l in result.stdout.splitlines()]
    more = f"\n[{len(lines) - max_lines} more lines]" if len(lines) > max_lines else ""
    return ToolResult(clip("\n".join(lines[:max_lines]), limit) + more if lines else empty)


def _list_dir(sb: Sandbox, path: str = ".", *, limit: int) -> ToolResult:
    # directories get a trailing "/"; hidden entries (.git, caches) are left out
    argv = [
        "find",
        path,
        "-mindepth",
        "1",
        "-maxdepth",
        "2",
        "-name",
        ".*",
        "-prune",
        "-o",
        "-type",
        "d",
        "-printf",
        "%P/\\n",
        "-o",
        "-printf",
        "%P\\n",
    ]
    result = _command(sb, argv, limit, MAX_LIST_ENTRIES, f"({path} is empty)")
    if result.error is None and result.output != f"({path} is empty)":
        result.output = "\n".join(sorted(result.output.split("\n"), key=lambda l: (l.startswith("["), l)))
    return result


def _grep(sb: Sandbox, pattern: str, path: str = ".", *, limit: int) -> ToolResult:
    # without a path argument grep -r searches "." and prints paths without the "./" prefix
    argv = ["grep", "-rnIE", "--exclude-dir=.[!.]*", "-e", pattern] + (["--", path] if path != "." else [])
    return _command(sb, argv, limit, MAX_GREP_LINES, "no matches", ok_codes=(0, 1))  # 1: nothing matched


def without_durations(output: str) -> str:
    """`output` with the durations pytest prints on its summary line taken out ("6 passed in 0.04s"
    reads "6 passed"). An observation must not depend on the machine's speed: with them, two
    demonstrations of the same episode differed in a third of the episodes, and the same `make demo`
    on the same machine trained different warm starts."""
    return _PYTEST_DURATION.sub(r"\1\2", output)


def _run(sb: Sandbox, command: str, timeout: int | None = None, *, limit: int) -> ToolResult:
    if timeout is not None and timeout < 1:
        return _error("timeout must be at least 1 second")
    wall = min(float(timeout or RUN_TIMEOUT_S), 4 * RUN_TIMEOUT_S)
    result = sb.exec(command, timeout=wall)
    out = result.stdout + (("\n" if result.stdout and not result.stdout.endswith("\n") else "") + result.stderr)
    out = without_durations(out)
    if result.timed_out:
        return _error(
            f"command timed out after {wall:.0f} s" + (f"; output so far:\n{clip(out, limit)}" if out else "")
        )
    flags = " (workspace size limit exceeded)" if result.workspace_exceeded else ""
    cut = " (output capped)" if result.stdout_truncated or result.stderr_truncated else ""
    return ToolResult(f"exit code {result.exit_code}{flags}{cut}\n{clip(out.rstrip(), limit)}".rstrip())


def _submit(sb: Sandbox, *, limit: int) -> ToolResult:
    return ToolResult("submitted", submitted=True)


_IMPL = {
    "read_file": _read_file,
    "edit_file": _edit_file,
    "write_file": _write_file,
    "list_dir": _list_dir,
    "grep": _grep,
    "run": _run,
    "submit": _submit,
}
assert set(_IMPL) == set(_PARAMS)


def execute(sandbox: Sandbox, name: str, arguments: dict | str, limit: int = 2000) -> ToolResult:
    """Run one tool call; `limit` caps the observation (chars, plus a short note)."""
    if name not in _IMPL:
        return _error(f"unknown tool {name!r} (tools: {', '.join(_IMPL)})")
    if not isinstance(arguments, dict):
        return _error(f"arguments of {name} must be a JSON object")
    problem = _check_arguments(name, arguments)
    if problem:
        return _error(problem)
    try:
        return _IMPL[name](sandbox, **arguments, limit=limit)
    except _Rejected as e:
        return _error(str(e))


def describe_call(name: str, arguments: dict | str) -> str:
    """One short line for progress output: `run: pytest -q`."""
    if isinstance(arguments, dict):
        main = arguments.get("command") or arguments.get("pattern") or arguments.get("path") or ""
        return f"{name}: {main}"[:120]
    return f"{name}: {arguments[:80]!r}"
