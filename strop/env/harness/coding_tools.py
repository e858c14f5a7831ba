"""strop's built-in coding tools: read, edit and write files, list, grep, run commands, submit.

Registered as entry points of the group `strop.tools` in strop's pyproject, one by one and as the set
`coding` (the default `[harness] tools`), exactly as an environment package registers its own
(`strop.env.harness.tools`). Schemas and observations are kept short on purpose: a tiny policy with a
~2k-token context pays for every byte of them. Long outputs keep their head and tail around a
"[... N chars cut ...]" marker, so pytest's summary line survives.

File tools act through the sandbox's confined host-side file API (fast, no process); `list_dir`,
`grep` and `run` execute real commands inside the sandbox, so their output looks exactly like
the production machine's.
"""

import difflib
import re

from strop.env.harness.tools import RUN_TIMEOUT_S, Tool, ToolError, ToolResult, clip, error
from strop.env.sandbox.interface import Sandbox

MAX_READ_LINES = 120  # lines per read_file call when no end is given
MAX_LIST_ENTRIES = 200
MAX_GREP_LINES = 60
MAX_LINE_CHARS = 200  # a grep hit or listed line longer than this is cut
HINT_MIN_RATIO = 0.6  # an edit's old text this alike to some lines of the file gets them shown in the error
HINT_MAX_LINES = 3000  # beyond this many lines the search for them costs more than the hint is worth
# the duration at the end of pytest's summary line: "6 passed in 0.04s", "== 1 failed in 1.20s (0:00:01) =="
_PYTEST_DURATION = re.compile(
    r"^(.*\b(?:passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?|no tests ran)\b.*?)"
    r" in \d+\.\d+s(?: \(\d+:\d\d:\d\d\))?( =+)?$",
    re.MULTILINE,
)


def _os_error(e: OSError, path: str) -> ToolError:
    if isinstance(e, FileNotFoundError):
        return ToolError(f"no such file: {path}")
    if isinstance(e, IsADirectoryError):
        return ToolError(f"{path} is a directory")
    return ToolError(f"{path}: {e.strerror or e}")  # permissions, symlink loops, not a directory


def _read_text(sb: Sandbox, path: str) -> str:
    try:
        data = sb.read_file(path)
    except OSError as e:
        raise _os_error(e, path) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{path} is not a UTF-8 text file ({len(data)} bytes)") from None


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
        return error("need 1 <= start <= end")
    if start > len(lines):
        return error(f"start={start} but {path} has {len(lines)} lines")
    stop = min(len(lines), end if end is not None else start + MAX_READ_LINES - 1)
    body = "\n".join(f"{i}| {lines[i - 1]}" for i in range(start, stop + 1))
    paged = end is None and stop < len(lines)  # the model asked for the whole file and got a page
    more = f"\n[{len(lines) - stop} more lines; read with start={stop + 1}]" if paged else ""
    return ToolResult(clip(body, limit) + more)


def _edit_file(sb: Sandbox, path: str, old: str, new: str, *, limit: int) -> ToolResult:
    if not old:
        return error("old must not be empty (use write_file to create a file)")
    if old == new:
        return error("old and new are the same")
    text = _read_text(sb, path)
    count = text.count(old)
    if count == 0:
        return error(f"old text not found in {path}" + _closest_hint(text, old))
    if count > 1:
        return error(f"old text occurs {count} times in {path}; add context to make it unique")
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
        return error(clip(result.stderr.strip() or f"exit code {result.exit_code}", limit))
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
        return error("timeout must be at least 1 second")
    wall = min(float(timeout or RUN_TIMEOUT_S), 4 * RUN_TIMEOUT_S)
    result = sb.exec(command, timeout=wall)
    out = result.stdout + (("\n" if result.stdout and not result.stdout.endswith("\n") else "") + result.stderr)
    out = without_durations(out)
    if result.timed_out:
        return error(f"command timed out after {wall:.0f} s" + (f"; output so far:\n{clip(out, limit)}" if out else ""))
    flags = " (workspace size limit exceeded)" if result.workspace_exceeded else ""
    cut = " (output capped)" if result.stdout_truncated or result.stderr_truncated else ""
    return ToolResult(f"exit code {result.exit_code}{flags}{cut}\n{clip(out.rstrip(), limit)}".rstrip())


def _submit(sb: Sandbox, *, limit: int) -> ToolResult:
    return ToolResult("submitted", submitted=True)


def _kw(fn):
    """A built-in written with keyword arguments, as a `Tool.function`."""
    return lambda sandbox, arguments, limit: fn(sandbox, **arguments, limit=limit)


def _params(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties} | ({"required": required} if required else {})


_S, _I = {"type": "string"}, {"type": "integer"}
READ_FILE = Tool(
    "read_file",
    "Show lines start..end of a file, numbered.",
    _params({"path": _S, "start": _I, "end": _I}, ["path"]),
    "read",
    _kw(_read_file),
)
EDIT_FILE = Tool(
    "edit_file",
    "Replace exact text old (must be unique) by new.",
    _params({"path": _S, "old": _S, "new": _S}, ["path", "old", "new"]),
    "edit",
    _kw(_edit_file),
)
WRITE_FILE = Tool(
    "write_file",
    "Create or overwrite a file.",
    _params({"path": _S, "content": _S}, ["path", "content"]),
    "edit",
    _kw(_write_file),
)
LIST_DIR = Tool("list_dir", "List files (2 levels).", _params({"path": _S}, []), "search", _kw(_list_dir))
GREP = Tool(
    "grep", "Search files for a regex.", _params({"pattern": _S, "path": _S}, ["pattern"]), "search", _kw(_grep)
)
RUN = Tool("run", "Run a shell command.", _params({"command": _S, "timeout": _I}, ["command"]), "run", _kw(_run))
SUBMIT = Tool("submit", "Finish; your changes are final.", _params({}, []), "submit", _kw(_submit))
CODING = (READ_FILE, EDIT_FILE, WRITE_FILE, LIST_DIR, GREP, RUN, SUBMIT)
