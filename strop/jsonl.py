"""Reading JSON Lines files a user hands strop (task files, logged sessions): one object per line,
blank lines skipped, and a bad line or an unreadable file named in one line (a `UserError`)."""

import json
from pathlib import Path
from typing import Any, Iterator

from strop.errors import UserError


def read_records(path: str | Path, what: str) -> Iterator[tuple[str, Any]]:
    """("FILE:LINE", the line's JSON value) for every non-blank line of `path`; `what` names the file
    in errors ("task file", "sft.traces")."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{what} {str(p)!r} {'does not exist' if not p.exists() else 'is not a file'}")
    try:
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{p.name}:{n}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {str(p)!r} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{what} {str(p)!r} cannot be read: {e.strerror}") from None
