"""Which functions of a repository each of its tests runs, and how far from the test: one traced run.

The synthesizer (`strop.env.tasks.synth`) runs a repository's whole test suite once, through the
checker's own path (`strop.env.grading.checker.run_tests`), with a small pytest plugin written into
the repository (`PLUGIN`, loaded with `-p`). While each test runs (setup, call and teardown), a
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

import json

from strop.env.grading.junit import JunitCase
from strop.env.sandbox.interface import WORKDIR

MODULE = "_strop_probe"  # the plugin's module name in the repository's top directory
PROPERTY = "strop_calls"

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
