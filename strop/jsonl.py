"""Reading JSON Lines files a user hands strop (task files, logged sessions): one object per line,
blank lines skipped, and a bad line or an unreadable file named in one line (a `UserError`). A line
longer than a reader's bound is never held in memory: it comes as `TOO_LONG`, its text skipped."""

import json
from pathlib import Path
from typing import Any, Iterator, TextIO

from strop.errors import UserError

TOO_LONG = object()  # what `read_records` yields for a line past its `max_chars`
_CHUNK = 1 << 20


def _lines(f: TextIO, max_chars: int | None) -> Iterator[str | None]:
    """The lines of `f`, None for one longer than `max_chars` (read past in chunks, never whole)."""
    while True:
        line = f.readline() if max_chars is None else f.readline(max_chars + 1)
        if not line:
            return
        if max_chars is None or len(line) <= max_chars or line.endswith("\n"):
            yield line
            continue
        while (rest := f.readline(_CHUNK)) and not rest.endswith("\n"):
            pass
        yield None


def read_records(path: str | Path, what: str, max_chars: int | None = None) -> Iterator[tuple[str, Any]]:
    """("FILE:LINE", the line's JSON value) for every non-blank line of `path`, or `TOO_LONG` for a line
    of more than `max_chars` characters; `what` names the file in errors ("task file", "sft.traces")."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{what} {str(p)!r} {'does not exist' if not p.exists() else 'is not a file'}")
    try:
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(_lines(f, max_chars), 1):
                where = f"{p.name}:{n}"
                if line is None:
                    yield where, TOO_LONG
                    continue
                if not line.strip():
                    continue
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {str(p)!r} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{what} {str(p)!r} cannot be read: {e.strerror}") from None
