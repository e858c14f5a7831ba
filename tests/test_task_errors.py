"""A new user's mistakes, each said in one line naming the task, the field and the cause: a test id
that names no test, a test_patch that does not apply, an image without pytest, a test run killed by
its memory limit (`strop tasks validate`); mining in an image without pytest, or keeping nothing
(`strop tasks mine`). Real sandboxes, a real image, the CLI as a user runs it."""

import json
import subprocess
import sys

from strop.env.grading.diagnosis import no_report_reason, telling_line
from strop.env.grading.junit import first_failure
from strop.env.sandbox.interface import Limits
from tests.worldkit import calc_repo, git, image_layers, image_without_pytest, sources_outside, test_image  # noqa: F401

CODE = {"m.py": "def add(a, b):\n    return a - b\n"}
TESTS = {"tests/test_m.py": "from m import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"}
GOLD = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
# the test file's first line is not what this patch says it is
STALE = "--- a/tests/test_m.py\n+++ b/tests/test_m.py\n@@ -1 +1 @@\n-from calc import add\n+from m import add\n"
BIG = "from m import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n    assert len(bytearray(2 << 30))\n"


def strop(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strop.cli", *args], capture_output=True, text=True)


def task(name: str, **fields) -> dict:
    record = {"instance_id": name, "problem_statement": "make add add", "files": CODE, "patch": GOLD}
    return {**record, "hidden_tests": TESTS, "FAIL_TO_PASS": ["tests/test_m.py::test_add"], **fields}


def test_a_new_users_mistakes_are_one_line_each(test_image, image_without_pytest, tmp_path):
    records = [
        task("wrong-id", image=test_image, FAIL_TO_PASS=["tests/test_m.py::test_ad"]),
        task("stale-patch", image=test_image, files={**CODE, **TESTS}, hidden_tests={}, test_patch=STALE),
        task("no-pytest", image=image_without_pytest),
        # too little address space to load the interpreter: the loader's words, exit 127
        task("starved", image=test_image, memory_mb=8),
        task("greedy", image=test_image, memory_mb=400, hidden_tests={"tests/test_m.py": BIG}),
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = strop("tasks", "validate", str(path), "--jobs", "2")
    assert run.returncode == 1 and "0 of 5 tasks valid" in run.stdout, run.stdout + run.stderr
    lines = {line.split("'")[1]: line for line in run.stdout.splitlines() if line.startswith("task '")}
    assert sorted(lines) == ["greedy", "no-pytest", "stale-patch", "starved", "wrong-id"], run.stdout
    expected = {  # the field, and the cause in the runner's own words
        "wrong-id": ("FAIL_TO_PASS", "no such test id in FAIL_TO_PASS: tests/test_m.py::test_ad"),
        "stale-patch": ("'test_patch'", "does not apply"),
        "no-pytest": ("image", "No module named pytest"),
        "starved": ("memory_mb = 8", "failed to map segment"),
        "greedy": ("memory_mb = 400", "MemoryError in tests/test_m.py::test_add"),
    }
    for name, (field, cause) in expected.items():
        assert field in lines[name] and cause in lines[name], lines[name]
        assert "no junit report" not in lines[name] and "0/0 pass" not in lines[name], lines[name]


def test_mining_says_why_it_keeps_nothing(calc_repo, image_without_pytest, tmp_path):
    repo, _ = calc_repo
    out = tmp_path / "t.jsonl"
    run = strop("tasks", "mine", "--repo", str(repo), "--image", image_without_pytest, "--out", str(out))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "test runner does not start" in run.stderr and "No module named pytest" in run.stderr, run.stderr
    assert not out.exists()
    docs = tmp_path / "docs"  # a history without a commit that changes code and tests: nothing to keep
    docs.mkdir()
    git("init", "-q", cwd=docs)
    (docs / "README.md").write_text("hello\n")
    git("add", "-A", cwd=docs)
    git("commit", "-qm", "docs", cwd=docs)
    run = strop("tasks", "mine", "--repo", str(docs), "--out", str(out))
    assert run.returncode == 1 and "wrote 0 tasks" in run.stdout, run.stdout + run.stderr
    assert "strop: no tasks: none of the 1 commits walked changes both source code and a test file" in run.stderr


def test_the_runners_words_pick_the_telling_line():
    limits = Limits(memory_mb=300)
    crash = "MemoryError\nFatal Python error: init_importlib_external: external importer setup failed\n\n"
    assert telling_line(crash) == "MemoryError"
    assert no_report_reason(1, crash, limits).startswith("memory limit reached (memory_mb = 300): MemoryError")
    assert no_report_reason(137, "Killed\n", limits).startswith("killed (exit code 137): the CPU limit (cpu_s = 30)")
    assert no_report_reason(2, "", limits) == "no junit report (exit code 2)"
    segv = "crashed (exit code -11, SIGSEGV): a stack overflow or the memory limit (memory_mb = 300)"
    assert no_report_reason(-11, "", limits) == segv
    assert no_report_reason(2, "x" * 900, limits).endswith("...") and len(no_report_reason(2, "x" * 900, limits)) < 260


def test_a_module_that_does_not_import_is_named_with_its_error():
    xml = b"""<testsuites><testsuite><testcase classname="" name="tests.test_c" file="tests/test_c.py">
    <error message="collection failure">ImportError while importing test module
tests/test_c.py:1: in &lt;module&gt;
    import nothere
E   ModuleNotFoundError: No module named 'nothere'</error></testcase>
    <testcase classname="tests.test_d" name="test_d" file="tests/test_d.py">
    <failure message="AssertionError: one is not two&#10;assert 1 == 2">...</failure></testcase>
    </testsuite></testsuites>"""
    assert first_failure(xml) == ("tests/test_c.py", "ModuleNotFoundError: No module named 'nothere'")
    passing = b'<testsuites><testsuite><testcase classname="t" name="a" file="t.py"/></testsuite></testsuites>'
    assert first_failure(passing) is None
