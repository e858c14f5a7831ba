"""Which functions of a repository each of its tests runs, and how far from the test: one traced run.

`trace` runs a repository's whole test suite once (for the synthesizer, `strop.env.tasks.synth`),
through the checker's own path (`strop.env.grading.checker.run_tests`), with a small pytest plugin
written into the repository (`PLUGIN`, loaded with `-p`). While each test runs (setup, call and teardown), a
`sys.settrace` hook sees every call of a function whose code lies in one of the repository's source
files and records it under the test as (file, first line of the function: its code object's
`co_firstlineno`) with its distance: how many source-file frames stand between the test's own frame
and the call, the call included (1 = the test called it). The records travel back as a property of
each test in the JUnit report.

Why it is safe to run only the tests that ran a function: a bug inside a function's body changes
nothing but what that body does when it runs, so a test that never ran the function passes with
the bug as it did without it. What the plugin cannot see (code run by `exec` from a string, a C
extension calling back into Python without a frame of its own) is not a function of a source file
in the first place. Tracing costs time (every call of a source function runs the hook), once.
"""

import fnmatch
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from xml.etree.ElementTree import ParseError

from strop.env.grading.checker import run_tests, task_limits
from strop.env.grading.junit import JunitCase, junit_cases
from strop.env.runner import is_test_path
from strop.env.sandbox.interface import WORKDIR
from strop.env.task import Task
from strop.env.tasks.mine import NOT_CODE
from strop.errors import UserError

MODULE = "_strop_probe"  # the plugin's module name in the repository's top directory
PROPERTY = "strop_calls"
_GO_ON = "--continue-on-collection-errors"  # a module that does not import leaves the others to run

PLUGIN = '''"""strop's probe (strop.env.tasks.probe): which source functions each test runs, and how deep."""
import json
import sys
import threading

import pytest

ROOT = %(root)r
SOURCES = %(sources)r  # absolute path -> index
_calls = None


def _trace(frame, event, arg):
    calls = _calls
    if calls is None or event != "call":
        return None
    code = frame.f_code
    index = SOURCES.get(code.co_filename)
    if index is None:
        return None
    key = (index, code.co_firstlineno)
    known = calls.get(key, 1 << 30)
    depth, up = 0, frame
    while up is not None and depth < known:  # deeper than a chain already seen: nothing to learn
        name = up.f_code.co_filename
        if name in SOURCES:
            depth += 1
        elif name.startswith(ROOT):  # a test module or a conftest: where the chain from the test starts
            break
        up = up.f_back
    if depth < known:
        calls[key] = depth
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _calls
    _calls = {}
    threading.settrace(_trace)
    sys.settrace(_trace)
    yield
    sys.settrace(None)
    threading.settrace(None)
    _calls = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and _calls is not None:
        found = sorted([i, line, d] for (i, line), d in _calls.items())
        item.user_properties.append((%(property)r, json.dumps(found, separators=(",", ":"))))
    yield
'''


@dataclass
class Baseline:
    """The traced run of the whole suite: the source files, how many tests were collected, the passing
    tests (id -> seconds), and for each function (path, first line) the passing tests that ran it
    (id -> distance)."""

    sources: list[str]
    collected: int
    passing: dict[str, float]
    runs: dict[tuple[str, int], dict[str, int]]

    def to_dict(self) -> dict:
        runs = [[path, line, tests] for (path, line), tests in sorted(self.runs.items())]
        return {"sources": self.sources, "collected": self.collected, "passing": self.passing, "runs": runs}

    @staticmethod
    def from_dict(d: dict) -> "Baseline":
        runs = {(path, line): tests for path, line, tests in d["runs"]}
        return Baseline(d["sources"], d["collected"], d["passing"], runs)


def source_files(tree: Path) -> list[str]:
    """The repository's Python source files: not tests, documentation or hidden directories, not a
    `setup.py`, never through a link."""
    found = []
    for d, dirs, files in os.walk(tree):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and not os.path.islink(os.path.join(d, x)))
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(d, f), tree).replace(os.sep, "/")
            if not f.endswith(".py") or f == "setup.py" or os.path.islink(os.path.join(d, f)):
                continue
            if is_test_path(rel) or any(fnmatch.fnmatchcase(rel, g) for g in NOT_CODE):
                continue
            found.append(rel)
    return found


def trace(task: Task, sources: list[str]) -> Baseline:
    """Run the whole test suite of `task`'s starting repository (its source files `sources`) once,
    traced, under the task's limits; UserError (one line) when no test runs or none passes."""
    task = replace(task, test_command=[*task.test_command, _GO_ON, "-p", MODULE])
    run = run_tests(task, {f"{MODULE}.py": plugin(sources)}, {}, [], task_limits(task), graded=False)
    where = f"at {task.base_commit[:12]} in {task.image or 'the host root'}"
    if run.setup_failed:
        raise UserError(f"the recipe's setup failed {where}: {run.setup_failed}")
    if run.timed_out:
        raise UserError(f"the whole suite, traced, outlived {task.metadata['timeout_s']:g} s {where}")
    try:
        cases = junit_cases(run.report) if run.report else None
    except ParseError:
        cases = None
    if not cases:
        why = "no test report" if cases is None else "no tests collected"
        raise UserError(f"no test ran {where}: {why} (exit {run.exit_code}); does the image have pytest?")
    passing = {t: round(c.seconds, 3) for t, c in sorted(cases.items()) if c.outcome == "passed"}
    if not passing:
        bad = next(t for t, c in sorted(cases.items()))
        raise UserError(f"no test passes {where} ({len(cases)} collected, e.g. {bad}: {cases[bad].outcome})")
    runs: dict[tuple[str, int], dict[str, int]] = {}
    for test_id in passing:
        for code, depth in calls(cases[test_id], sources).items():
            runs.setdefault(code, {})[test_id] = depth
    return Baseline(sources, len(cases), passing, runs)


def plugin(sources: list[str]) -> str:
    """The plugin's source for a repository whose source files are `sources` (relative paths)."""
    absolute = {f"{WORKDIR}/{path}": i for i, path in enumerate(sources)}
    return PLUGIN % {"root": WORKDIR + "/", "sources": absolute, "property": PROPERTY}


def calls(case: JunitCase, sources: list[str]) -> dict[tuple[str, int], int]:
    """What one test ran, from its JUnit case: (source file, function's first line) -> distance."""
    raw = case.properties.get(PROPERTY)
    if not raw:
        return {}
    return {(sources[i], line): depth for i, line, depth in json.loads(raw)}
