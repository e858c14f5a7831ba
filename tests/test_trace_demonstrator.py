"""The demonstrator that follows the failing tests' traceback (`strop.env.demonstrators.trace`), on
tasks synthesized (`strop tasks synth`, real sandboxes) from a small repository built here whose
bugs sit 1 and 2 calls below the tests: it solves every one, and every argument it writes (test id,
name, path, line numbers, an edit's old text) was in its context window before it wrote it."""

import re
import shlex
from dataclasses import replace

import pytest

from strop.env.demonstrators.imperfect import DemoStyle
from strop.env.demonstrators.runs import DEMONSTRATION_HARNESS, demonstrator_client, solve
from strop.env.demonstrators.trace import TraceDemonstrator, hunk_edits, traceable
from strop.env.grading.checker import check
from strop.env.harness.loop import Harness, run_task
from strop.env.tasks.suites import load_suite
from strop.env.tasks.synth import synth
from tests.test_synth import make_repo

GEO = """def _add(a, b):
    return a + b


def perimeter(w, h):
    return 2 * _add(w, h)


class Box:
    def __init__(self, w, h):
        self.w = w
        self.h = h

    def area(self):
        if self.w < 0:
            raise ValueError("negative")
        return self.w * self.h
"""
TESTS = """from geo import Box, perimeter


def test_perimeter():
    assert perimeter(2, 3) == 10


def test_box():
    box = Box(2, 3)
    assert box.area() == 6
"""


@pytest.fixture(scope="module")
def geo_tasks(tmp_path_factory) -> list:
    root = tmp_path_factory.mktemp("repos")
    repo = make_repo(root / "geo", {"src/geo/__init__.py": GEO, "tests/test_geo.py": TESTS})
    out = root / "geo.jsonl"
    synth(str(repo), out, max_tasks=4, combined=1, eval_fraction=0.0, jobs=2, progress=False)
    return load_suite(f"jsonl:{out}", "train")


class Recording:
    """A demonstrator that keeps the window it was shown at each turn."""

    def __init__(self, inner: TraceDemonstrator):
        self.inner, self.windows = inner, []

    def generate(self, prompt_ids, params):
        self.windows.append(self.inner.fmt.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return self.inner.generate(prompt_ids, params)


def seen_lines(window: str, path: str) -> set[int]:
    """Line numbers of `path` the window showed: traceback frames and grep hits (`path:12:`), and
    the numbered lines of a read of it (`12| ...`, after the call that names the path)."""
    lines = {int(n) for n in re.findall(rf"(?<![\w./-]){re.escape(path)}:(\d+):", window)}
    for read in window.split(f'"path": "{path}"')[1:]:
        lines |= {int(n) for n in re.findall(r"^(\d+)\| ", read, re.MULTILINE)}
    return lines


def assert_seen_first(call: dict, window: str) -> None:
    """Every argument of `call` appears in the window the demonstrator wrote it after."""
    name, args = call["name"], call["arguments"]
    if name == "run":
        ids = [w for w in shlex.split(args["command"]) if "::" in w]
        assert ids and all(t in window for t in ids), args
    elif name == "grep":
        (function,) = re.fullmatch(r"\(def\|class\) (\w+)\\b", args["pattern"]).groups()
        assert function in window, function
    elif name == "read_file":
        assert args["path"] in window
        assert seen_lines(window, args["path"]) & set(range(args["start"], args["end"] + 1)), args
    elif name == "edit_file":
        assert args["path"] in window
        assert all(line in window for line in args["old"].splitlines()), args["old"]
    else:
        assert name == "submit", name


def test_it_finds_every_bug_from_what_its_window_shows(geo_tasks, tiny_tokenizer):
    assert geo_tasks and all(traceable(t) for t in geo_tasks)
    # `_add` is 2 calls below test_perimeter; Box.__init__ raises in its own frame
    assert {(t.metadata["function"], t.metadata["distance"]) for t in geo_tasks} >= {("_add", 2), ("Box.__init__", 1)}
    harness = Harness(tiny_tokenizer, replace(DEMONSTRATION_HARNESS, max_context=4096))
    for task in geo_tasks:
        client = Recording(demonstrator_client(task, harness.format))
        episode, changes = run_task(harness, client, task)
        calls = episode.tool_calls
        assert episode.stop_reason == "submitted" and not client.inner.blind, (task.id, calls)
        assert check(task, changes, perturbed=False).reward == 1.0, task.id
        assert calls[0]["name"] == "run" and calls[-2]["name"] == "run"  # failing tests first and last
        assert len(client.windows) == len(calls)
        for call, window in zip(calls, client.windows):
            assert_seen_first(call, window)
        edits = [c for c in calls if c["name"] == "edit_file"]
        assert len(edits) == len(hunk_edits(task)) and all(c["error"] is None for c in calls)
        if task.metadata["function"] == "_add" and task.metadata["distance"] == 2:
            assert "_add" not in task.instruction  # the statement names only tests
            assert [c["arguments"].get("pattern") for c in calls if c["name"] == "grep"][-1] == r"(def|class) _add\b"


def test_imperfect_styles_and_the_old_opening(geo_tasks, tiny_tokenizer):
    task = next(t for t in geo_tasks if t.metadata["family"] != "combined")
    config = replace(DEMONSTRATION_HARNESS, max_context=4096)
    slip = {**hunk_edits(task)[0], "kind": "misremember"}
    slip["old"] = "    " + slip["old"]  # one indentation level too deep: edit_file rejects it
    harness = Harness(tiny_tokenizer, config)
    for careful in (True, False):
        style = DemoStyle(careful=careful, run_tests=careful, wrong=(slip,))
        episode, changes = run_task(harness, demonstrator_client(task, harness.format, style), task)
        errors = [c["error"] is not None for c in episode.tool_calls if c["name"] == "edit_file"]
        assert errors == ([True, False] if careful else [True]), episode.tool_calls
        assert check(task, changes, perturbed=False).reward == (1.0 if careful else 0.0)
    # the old opening, kept to measure against, still greps the metadata's function name
    report = solve([task], tiny_tokenizer, config, trace=False)
    assert report["solved"] == 1 and report["results"][0]["blind"] is False
    report = solve([task], tiny_tokenizer, config)
    assert report["solved"] == 1 and list(report["episodes"]) == [task.id]


def test_hunk_edits_split_a_fix_by_function():
    from strop.env.task import Task

    fixed = GEO
    buggy = GEO.replace("return a + b", "return a - b").replace("self.w * self.h", "self.w + self.h")
    task = Task(
        id="t",
        suite="s",
        split="train",
        instruction="",
        files={"geo.py": buggy},
        metadata={"reference_edits": [{"path": "geo.py", "old": buggy, "new": fixed}]},
    )
    edits = hunk_edits(task)
    assert [(e["old"], e["new"]) for e in edits] == [
        ("    return a - b\n", "    return a + b\n"),
        ("        return self.w + self.h\n", "        return self.w * self.h\n"),
    ]
