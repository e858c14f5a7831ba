"""Reading the JUnit XML report a test run writes: counts of outcomes, each test's outcome (and
failure output, and properties) by its pytest node id (how FAIL_TO_PASS names tests), and the first
failure's message."""

import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field


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


@dataclass
class JunitCase:
    """One test of a JUnit report: its outcome, what its failure or error said (pytest's message, the
    exception's line, and its text, the traceback), its duration and its properties (`record_property`)."""

    outcome: str
    message: str = ""
    text: str = ""
    seconds: float = 0.0
    properties: dict[str, str] = field(default_factory=dict)


def junit_outcomes(xml: bytes) -> dict[str, str]:
    """Test id (pytest's node id, as FAIL_TO_PASS names tests) -> "passed", "failed", "error" or
    "skipped", from a JUnit report in the xunit1 family (whose testcases carry their `file`). A test
    reported twice (a failed call, then an error at teardown) keeps its worst outcome; a module that
    failed to import is reported under its file's path."""
    return {test_id: case.outcome for test_id, case in junit_cases(xml).items()}


def junit_cases(xml: bytes) -> dict[str, JunitCase]:
    """Test id -> its `JunitCase`, as `junit_outcomes` names and ranks them (the worst report of a test
    gives its outcome and failure output; the durations add up; the properties merge)."""
    out: dict[str, JunitCase] = {}
    for test_id, kind, case in _cases(xml):
        failure = next((c for c in case if c.tag in ("error", "failure")), None)
        seen = out.setdefault(test_id, JunitCase("passed"))
        if _WORST[kind] >= _WORST[seen.outcome]:
            seen.outcome = kind
            if failure is not None:
                seen.message, seen.text = failure.get("message", ""), failure.text or ""
        try:
            seen.seconds += float(case.get("time", 0) or 0)
        except ValueError:
            pass  # a report that says no number says no duration
        seen.properties.update({p.get("name", ""): p.get("value", "") for p in case.iter("property")})
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
