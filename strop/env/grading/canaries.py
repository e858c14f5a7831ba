"""Canaries: tests that must fail, run among a check's hidden tests, so that a forged outcome shows.

pytest runs the hidden tests in the process of the code they test, and code in a process reaches
all of it: the live pytest config (through `gc`), its plugin manager, its report file, its exit.
No channel out of that process is one the code cannot write. So the checker does not read a run's
passes as proof on their own: every pytest-graded run also collects a canary module that the code
under test never saw, written from the host at a fresh random name beside the hidden tests, whose
tests fail. A runner left alone reports the canaries failed and exits 1 (tests failed); a forgery
that passes what did not pass (a pass-everything plugin, a rewritten or forged report, `os._exit(0)`
in an exit handler) passes the canaries too, or loses them, or changes the exit code. The checker
scores a run with passes only when `verdict` finds the canaries as an honest runner leaves them.

The canaries are `unittest.TestCase` methods, which pytest collects whatever the repository's
configuration names test functions and classes, in a file named on the command line, which it
collects whatever its name; they run last (the command names them last), so a `-x` in the
repository's options stops at them only after the hidden tests ran.

Not covered: code that tells the canaries from the hidden tests (their source is on the disk it
can read) and forges only the others' outcome; tests that trust an object the code returns (an
`__eq__` that is always true). Tasks graded by values (`strop.env.grading.isolated`) close both.
"""

import random
import re
import secrets
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import PurePosixPath

from strop.env.grading.junit import case_outcome

FAILED = ("failed", "error")  # how a runner left alone reports a test that raised


@dataclass(frozen=True)
class Canaries:
    """A canary module: its path in the repository, its source, and the tests it holds."""

    path: str
    source: str
    names: tuple[str, ...]

    @property
    def module(self) -> str:
        return PurePosixPath(self.path).stem


def make_canaries(selected: list[str]) -> Canaries:
    """A fresh canary module beside the first of the `selected` test files or ids (a random name no
    repository holds), named like its neighbours."""
    first = PurePosixPath(selected[0].split("::")[0]) if selected else PurePosixPath("test_x.py")
    tag = secrets.token_hex(4)
    stem = re.sub(r"\W", "_", first.stem, flags=re.ASCII)  # a module and a class name: identifiers only
    stem = stem if stem.startswith("test") else f"test_{stem}"
    rng = random.Random(tag)
    words = ("bounds", "empty", "edge", "regression", "types", "large", "order", "repeat", "default", "nested")
    a, b = rng.sample(range(2, 1000), 2)
    names = (f"test_{rng.choice(words)}_{rng.randrange(2, 9)}", f"test_{rng.choice(words)}_values")
    cls = "Test" + "".join(w.capitalize() for w in stem.removeprefix("test").split("_") if w) + tag
    source = (
        "import unittest\n\n\n"
        f"class {cls}(unittest.TestCase):\n"
        f"    def {names[0]}(self):\n"
        f"        self.assertEqual({a} + {b}, {a + b + 1})\n\n"
        f"    def {names[1]}(self):\n"
        f"        raise ValueError({a})\n"
    )
    path = str(first.parent / f"{stem}_{tag}.py") if str(first.parent) != "." else f"{stem}_{tag}.py"
    return Canaries(path, source, names)


def _is_canary(case: ET.Element, canaries: Canaries) -> bool:
    # the classname is the file's path, dotted, then its class (whatever the JUnit family)
    return canaries.module in case.get("classname", "").split(".")


def split_report(xml: bytes, canaries: Canaries) -> tuple[bytes, dict[str, str]]:
    """(the report without the canaries' testcases, canary test name -> outcome); the report as it
    is and no outcomes when it is not XML."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError:
        return xml, {}
    found = {}
    for parent in list(root.iter()):
        for case in [c for c in parent if c.tag == "testcase" and _is_canary(c, canaries)]:
            name = case.get("name", "")
            if found.get(name) not in FAILED:  # a test reported twice keeps its failing report
                found[name] = case_outcome(case)
            parent.remove(case)
    return ET.tostring(root), found


def verdict(canaries: Canaries, outcomes: dict[str, str], exit_code: int | None) -> str:
    """Why the run's outcome cannot be trusted, or "" when the canaries are as a runner left alone
    leaves them: each one it reports failed, at least one reported (a `-x` stops after the first),
    exit code 1."""
    wrong = [f"{n} {outcomes[n]}" for n in canaries.names if n in outcomes and outcomes[n] not in FAILED]
    if wrong or not outcomes:
        what = ", ".join(wrong) or "not reported"
        return f"the report cannot be trusted: the canary tests, which fail, were reported so ({what})"
    if exit_code != 1:
        return f"the runner exited {exit_code}, not 1, with failing canary tests in its report"
    return ""
