"""A synthesized task's problem statement, written without a model: what its user would see.

A bug report that a developer gets from CI: which tests fail, and, at a level of detail the caller
chooses (`Detail`), what they said:

- `names`: the failing tests' ids, nothing else ("the tests named X fail");
- `errors`: and each one's failure in one line (pytest's message: the assertion with expected and
  got, or the exception);
- `full`: and each one's whole failure output (the traceback pytest printed, its assertion
  introspection), clipped.

Memory addresses (`0x7f...`) are masked, so the statement of a bug does not change from one run to
the next; the tests' own output is otherwise given as it is (it is what the user would see).
"""

import re
from typing import Literal

from strop.env.grading.junit import JunitCase

Detail = Literal["names", "errors", "full"]
DETAILS: tuple[Detail, ...] = ("names", "errors", "full")
MAX_TESTS = 5  # tests whose failure is shown; the rest are named
MAX_NAMES = 20  # tests named; the rest are counted
MAX_MESSAGE = 300
MAX_OUTPUT = 2000
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def _clip(text: str, limit: int) -> str:
    text = _ADDRESS.sub("0x...", text.strip())
    return text if len(text) <= limit else text[: limit - 15].rstrip() + " [... clipped]"


def statement(failing: dict[str, JunitCase], detail: Detail) -> str:
    """The problem statement of a bug whose failing tests (id -> their JUnit case) are `failing`."""
    ids = sorted(failing)
    shown = ids[: MAX_TESTS if detail != "names" else MAX_NAMES]
    many = len(ids) > 1
    lines = [
        f"{len(ids)} test{'s' if many else ''} of this repository fail{'' if many else 's'}. Find the bug in the "
        f"source code (not in the tests) and fix it so that {'they pass' if many else 'it passes'}."
    ]
    if detail == "names":
        lines += ["", "Failing tests:", *(f"- {t}" for t in shown)]
        return "\n".join(lines + _more(len(ids) - len(shown)))
    for test_id in shown:
        case = failing[test_id]
        lines += ["", f"{test_id}: {_clip(case.message, MAX_MESSAGE) or case.outcome}"]
        if detail == "full" and case.text.strip():
            lines += ["```", _clip(case.text, MAX_OUTPUT), "```"]
    rest = ids[len(shown) : len(shown) + MAX_NAMES]
    if rest:
        lines += ["", "Also failing:", *(f"- {t}" for t in rest)]
    return "\n".join(lines + _more(len(ids) - len(shown) - len(rest)))


def _more(n: int) -> list[str]:
    return [f"... and {n} more"] if n > 0 else []
