"""Text that a policy or a task wrote, made safe to print on a user's terminal: a terminal obeys
escape sequences (ESC [ ... moves the cursor, rewrites the title, hides text; OSC 8 makes links) and
Unicode's invisible controls reorder what a line seems to say, so these are shown as escapes
(`\\x1b`, `\\u202e`) instead of sent. Line breaks and tabs stay."""

import sys
import unicodedata
from typing import TextIO

_KEPT = frozenset("\n\t")


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """`text` with every control and format character but newline and tab shown as an escape."""
    if text.isprintable():  # the common case, fast: no control or format character at all
        return text
    return "".join(
        _escape(c) if c not in _KEPT and unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn") else c for c in text
    )


def show(text: str, file: TextIO | None = None) -> None:
    """Print `text` (what a policy, a task or a test run wrote) with its escapes shown, never sent."""
    print(printable(text), file=file or sys.stdout)
