"""Reading the JUnit XML report a test run writes: counts of outcomes, each test's outcome by its
pytest node id (how FAIL_TO_PASS names tests), and the first failure's message."""

import xml.etree.ElementTree as ET
from collections import Counter


def case_outcome(case: ET.Element) -> str:
    """How one JUnit <testcase> ended: "error", "failed", "skipped" or "passed" (the first that applies)."""
    tags = {child.tag for child in case}
    return next(
        (k for t, k in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")) if t in tags), "passed"
    )


def parse_junit(xml: bytes) -> tuple[int, int, int, int]:
    """(passed, failed, errors, skipped) over every <testcase> of a JUnit report."""
    kinds = Counter(case_outcome(case) for case in ET.fromstring(xml).iter("testcase"))
    return kinds["passed"], kinds["failed"], kinds["error"], kinds["skipped"]


_WORST = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def _cases(xml: bytes) -> list[tuple[str, str, ET.Element]]:
    """(test id, outcome, element) of every <testcase> of a JUnit report in the xunit1 family (see
    `junit_outcomes`), in report order."""
    cases = list(ET.fromstring(xml).iter("testcase"))
    # the classname is the test's module path, dotted, then its classes: the module is the longest
    # prefix naming a file of the report (a method inherited from another module carries that one's file)
    files = {c.get("file", "") for c in cases}
    out = []
    for case in cases:
        classname, name, file = case.get("classname", ""), case.get("name", ""), case.get("file", "")
        if not classname:  # a collection error: the name is the module, dotted
            test_id = file or name.replace(".", "/") + ".py"
        else:
            parts = classname.split(".")
            k = next((k for k in range(len(parts), 0, -1) if "/".join(parts[:k]) + ".py" in files), 0)
            module, classes = ("/".join(parts[:k]) + ".py", parts[k:]) if k else (file, [])
            test_id = "::".join([module, *classes, name])
        out.append((test_id, case_outcome(case), case))
    return out


def junit_outcomes(xml: bytes) -> dict[str, str]:
    """Test id (pytest's node id, as FAIL_TO_PASS names tests) -> "passed", "failed", "error" or
    "skipped", from a JUnit report in the xunit1 family (whose testcases carry their `file`). A test
    reported twice (a failed call, then an error at teardown) keeps its worst outcome; a module that
    failed to import is reported under its file's path."""
    out: dict[str, str] = {}
    for test_id, kind, _ in _cases(xml):
        if _WORST[kind] >= _WORST.get(out.get(test_id, "passed"), 0):
            out[test_id] = kind
    return out


def first_failure(xml: bytes) -> tuple[str, str] | None:
    """(test id, message) of the first test of a JUnit report that failed or errored, or None when
    none did. The message is pytest's summary (the exception and its text), or for a module that did
    not import the traceback's last `E` line (the summary only says "collection failure")."""
    for test_id, kind, case in _cases(xml):
        if kind in ("failed", "error"):
            child = next(c for c in case if c.tag in ("failure", "error"))
            lines = (child.text or "").strip().splitlines()
            raised = [line[1:] for line in lines if line.startswith("E ")]
            message = child.get("message", "")
            if raised and message in ("", "collection failure"):
                message = raised[-1]
            return test_id, " ".join((message or (lines[-1] if lines else "")).split())
    return None
