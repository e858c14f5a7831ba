"""Tasks mined from a repository's history (`strop tasks mine`) and task files validated
(`strop tasks validate`): real git repositories, real sandboxes on the host's root and on an image,
the checker's own test runs."""

import difflib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strop.env.grading.junit import junit_outcomes
from strop.env.tasks.mine import mine, report_path
from strop.env.tasks.suites import load_suite
from strop.env.tasks.touched_tests import touched_tests
from tests.worldkit import calc_repo, git, image_layers, sources_outside, test_image  # noqa: F401


def strop(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strop.cli", *args], capture_output=True, text=True, cwd=cwd)


def outcomes(report: dict) -> dict[str, tuple[str, str]]:
    return {c["commit"]: (c["outcome"], c["detail"]) for c in report["commits"]}


def test_junit_outcomes_name_tests_by_node_id():
    xml = b"""<testsuites><testsuite>
    <testcase classname="tests.test_a.TestA" name="test_x" file="tests/test_a.py"/>
    <testcase classname="tests.test_a.TestA" name="test_p[1-2]" file="tests/test_a.py"><failure/></testcase>
    <testcase classname="tests.test_a" name="test_y" file="tests/test_a.py"><skipped/></testcase>
    <testcase classname="tests.test_a" name="test_z" file="tests/test_a.py"/>
    <testcase classname="tests.test_a" name="test_z" file="tests/test_a.py"><error/></testcase>
    <testcase classname="tests.test_b.TestB" name="test_inherited" file="tests/base.py"/>
    <testcase classname="tests.test_b" name="test_b" file="tests/test_b.py"/>
    <testcase classname="" name="tests.test_c" file="tests/test_c.py"><error/></testcase>
    </testsuite></testsuites>"""
    assert junit_outcomes(xml) == {
        "tests/test_a.py::TestA::test_x": "passed",
        "tests/test_a.py::TestA::test_p[1-2]": "failed",
        "tests/test_a.py::test_y": "skipped",
        "tests/test_a.py::test_z": "error",  # passed its call, then errored at teardown: the worst counts
        "tests/test_b.py::TestB::test_inherited": "passed",  # its file is where the method was written
        "tests/test_b.py::test_b": "passed",
        "tests/test_c.py": "error",  # the module did not import
    }


def test_touched_tests_are_what_a_diff_changes():
    before = "import x\n\n\ndef test_a():\n    pass\n\n\nclass TestK:\n    def test_m(self):\n        pass\n"
    after = (
        "import x\nimport y\n\n\ndef test_a():\n    pass\n\n\n@mark\ndef test_new():\n    pass\n\n\n"
        "class TestK:\n    def helper(self):\n        pass\n\n    def test_m(self):\n        pass\n\n\n"
        "class Other(unittest.TestCase):\n    def test_o(self):\n        pass\n\n\n"
        "class NotATest:\n    def test_z(self):\n        pass\n"
    )
    patch = "".join(
        difflib.unified_diff(before.splitlines(True), after.splitlines(True), "a/tests/test_t.py", "b/tests/test_t.py")
    )
    patch = "diff --git a/tests/test_t.py b/tests/test_t.py\n" + patch
    assert touched_tests(patch, {"tests/test_t.py": after}) == [
        "tests/test_t.py::Other::test_o",  # a new TestCase class: its test methods
        "tests/test_t.py::TestK",  # a helper inside the class: the whole class
        "tests/test_t.py::test_new",  # its decorator counts as its own line
    ]  # the import is no test; test_a and the class pytest does not collect are untouched
    only_imports = patch.split("@@")[0] + "@@ -1 +1,2 @@\n import x\n+import y\n"
    assert touched_tests(only_imports, {"tests/test_t.py": after}) == ["tests/test_t.py"]  # nothing: the module
    assert touched_tests(patch, {"tests/test_t.py": "def broken(:\n"}) == ["tests/test_t.py"]


def check_calc_tasks(out: Path, shas: dict[str, str], image: str = "") -> None:
    """The tasks mined from `calc_repo`: its two fix-and-test commits, chronologically split."""
    report = json.loads(report_path(out).read_text())
    assert (report["commits_walked"], report["candidates"], report["kept"]) == (5, 3, 2)
    assert (report["train"], report["eval"]) == (1, 1)
    assert report["dropped"] == {
        "no test module": 0,
        "timeout": 0,
        "does not build": 0,
        "no failing test": 1,
        "flaky": 0,
    }
    by_commit = outcomes(report)
    assert by_commit[shas["already_passing"]] == ("no failing test", "3 tests pass at the parent too")
    assert [c["commit"] for c in report["commits"]] == [shas["fix_add"], shas["already_passing"], shas["add_sub"]]
    train, ev = load_suite(f"jsonl:{out}", "train"), load_suite(f"jsonl:{out}", "eval")
    (fix,), (feature,) = train, ev  # the newest commit is held out
    assert fix.id == f"calc-{shas['fix_add'][:12]}" and feature.id == f"calc-{shas['add_sub'][:12]}"
    assert fix.instruction == "Fix add: it subtracted\n\nadd(1, 2) returned -1."
    assert (fix.base_commit, fix.fail_to_pass, fix.pass_to_pass) == (
        shas["initial"],
        ["tests/test_calc.py::test_add"],
        ["tests/test_calc.py::test_mul"],
    )
    assert "calc.py" in fix.gold_patch and "tests/" not in fix.gold_patch and "test_add" in fix.test_patch
    # the new test module imports what the commit adds: every test in it fails at the parent
    assert feature.base_commit == shas["already_passing"] and not feature.pass_to_pass
    assert feature.fail_to_pass == [f"tests/test_calc.py::test_{n}" for n in ("add", "mul", "mul_zero", "sub")]
    assert {t.image for t in train + ev} == {image}
    line = json.loads(out.read_text().splitlines()[0])
    assert line["repo"] == os.path.relpath(Path(fix.repo), out.parent) and not Path(line["repo"]).is_absolute()


def test_mine_on_the_host_root_keeps_fix_and_test_commits_deterministically(calc_repo, tmp_path):
    repo, shas = calc_repo
    first = tmp_path / "calc.jsonl"
    report = mine(str(repo), first, jobs=2, progress=False)
    assert report == json.loads(report_path(first).read_text())
    check_calc_tasks(first, shas)
    # the same repository and image give the same bytes, however many jobs ran
    again = tmp_path / "again.jsonl"
    mine(str(repo), again, jobs=1, progress=False)
    assert again.read_bytes() == first.read_bytes()
    assert report_path(again).read_bytes() == report_path(first).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "again.jsonl",
        "again.report.json",
        "calc.jsonl",
        "calc.report.json",
    ]


def test_mine_only_the_touched_tests(calc_repo, tmp_path):
    repo, shas = calc_repo
    report = mine(str(repo), tmp_path / "calc.jsonl", tests="touched", progress=False)
    assert (report["kept"], report["tests"]) == (2, "touched")
    fix, feature = load_suite(f"jsonl:{tmp_path / 'calc.jsonl'}")
    assert (fix.fail_to_pass, fix.pass_to_pass) == (["tests/test_calc.py::test_add"], [])
    assert (feature.fail_to_pass, feature.pass_to_pass) == (["tests/test_calc.py::test_sub"], [])


def test_mine_and_validate_in_an_image(calc_repo, test_image, tmp_path):
    """The same commits mined in an image world (its python3 and pytest, not the host's); the file
    validates through `strop tasks validate`, and a hand-broken copy of it does not."""
    repo, shas = calc_repo
    out = tmp_path / "calc.jsonl"
    run = strop("tasks", "mine", "--repo", str(repo), "--image", test_image, "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert "no failing test  1" in run.stdout and "wrote 2 tasks (1 train, 1 eval)" in run.stdout, run.stdout
    check_calc_tasks(out, shas, image=test_image)
    run = strop("tasks", "validate", str(out), "--json", str(tmp_path / "v.json"))
    assert run.returncode == 0 and "2 of 2 tasks valid" in run.stdout, run.stdout + run.stderr
    verdicts = {v["task"]: v for v in json.loads((tmp_path / "v.json").read_text())}
    assert verdicts[f"calc-{shas['fix_add'][:12]}"] == {
        "task": f"calc-{shas['fix_add'][:12]}",
        "ok": True,
        "gold": "2/2 pass",
        "base": "1/1 fail",
        "problem": "",
    }
    fix, feature = (json.loads(line) for line in out.read_text().splitlines())
    fix["FAIL_TO_PASS"] += fix.pop("PASS_TO_PASS")  # a test that passes at the start cannot fail to pass
    feature["patch"] = feature["patch"].replace("+    return a - b", "+    return a + b")  # a wrong sub
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(fix) + "\n" + json.dumps(feature) + "\n")
    run = strop("tasks", "validate", str(broken))
    assert run.returncode == 1 and "0 of 2 tasks valid" in run.stdout, run.stdout + run.stderr
    assert "1 of 2 FAIL_TO_PASS tests pass at the start already, e.g. tests/test_calc.py::test_mul" in run.stdout
    assert "the gold patch (field 'patch') does not pass: 1 of 4 tests did not pass" in run.stdout, run.stdout


def edge_repo(path: Path) -> dict[str, str]:
    """A repository whose every candidate is dropped, one reason each."""
    path.mkdir()
    git("init", "-q", "-b", "main", cwd=path)
    shas = {}

    def commit(name: str, **files: str) -> None:
        for rel, text in files.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(text)
        git("add", "-A", cwd=path)
        git("commit", "-q", "-m", name, cwd=path)
        shas[name] = git("rev-parse", "HEAD", cwd=path).strip()

    test = "from m import f\n\n\ndef test_f():\n    assert f() == 1\n"
    commit("initial", **{"m.py": "def f():\n    return 1\n", "tests/test_m.py": test})
    commit(
        "helpers only", **{"m.py": "def f():\n    return 1\n\n\ndef g():\n    pass\n", "tests/helpers.py": "X = 1\n"}
    )
    commit("broken", **{"m.py": "def f(:\n", "tests/test_m.py": test + "\n\ndef test_f2():\n    assert f() == 1\n"})
    slow = "import time\n\n\ndef f():\n    return 1\n\n\ndef spin():\n    time.sleep(60)\n"
    commit(
        "hangs",
        **{"m.py": slow, "tests/test_m.py": test.replace("f\n", "f, spin\n") + "\n\ndef test_spin():\n    spin()\n"},
    )
    order = (  # test_b passes only after test_a ran, and test_a fails: rerun by id, test_b fails
        "from m import f, h\n\nSEEN = []\n\n\ndef test_f():\n    assert f() == 1\n\n\n"
        "def test_a():\n    SEEN.append(1)\n    assert h() == 3\n\n\ndef test_b():\n    assert SEEN and h() == 2\n"
    )
    commit("order", **{"m.py": "def f():\n    return 1\n\n\ndef h():\n    return 2\n", "tests/test_m.py": order})
    return shas


def test_drops_say_why(tmp_path):
    shas = edge_repo(tmp_path / "edge")
    report = mine(str(tmp_path / "edge"), tmp_path / "edge.jsonl", timeout_s=3, progress=False)
    by_commit = outcomes(report)
    assert by_commit[shas["helpers only"]] == ("no test module", "tests/helpers.py")
    assert by_commit[shas["broken"]][0] == "does not build", by_commit
    assert "tests/test_m.py" in by_commit[shas["broken"]][1]  # the module that failed to import
    assert by_commit[shas["hangs"]] == ("timeout", "at the commit, after 3 s")
    assert by_commit[shas["order"]][0] == "flaky", by_commit
    assert "gold patch (field 'patch') does not pass: 1 of 2 tests did not pass" in by_commit[shas["order"]][1]
    assert report["kept"] == 0 and (tmp_path / "edge.jsonl").read_text() == ""
    assert report["dropped"] == {
        "no test module": 1,
        "timeout": 1,
        "does not build": 1,
        "no failing test": 0,
        "flaky": 1,
    }


def test_a_killed_mine_resumes_from_what_it_had(calc_repo, tmp_path):
    """Each commit's result is kept as it is known: a rerun after a kill reuses it."""
    repo, shas = calc_repo
    out = tmp_path / "calc.jsonl"
    partial = tmp_path / "calc.jsonl.partial"
    proc = subprocess.Popen(
        [sys.executable, "-m", "strop.cli", "tasks", "mine", "--repo", str(repo), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    entry = json.loads(partial.read_text().splitlines()[0])
    entry["result"]["detail"] += " (from before the kill)"
    partial.write_text(json.dumps(entry) + "\n")
    report = mine(str(repo), out, progress=False)
    assert outcomes(report)[entry["result"]["commit"]][1].endswith("(from before the kill)")
    assert not partial.exists()
    check_calc_tasks(out, shas)


@pytest.mark.parametrize(
    "args, why",
    [
        (
            ["mine", "--repo", "{repo}", "--image", "{tmp}/no-image", "--out", "{tmp}/t.jsonl"],
            "image .* does not exist",
        ),
        (["mine", "--repo", "{tmp}", "--out", "{tmp}/t.jsonl"], "is not a git repository"),
        (["mine", "--repo", "{repo}", "--rev", "no-such-ref", "--out", "{tmp}/t.jsonl"], "has no commit 'no-such-ref'"),
        (["mine", "--repo", "{repo}", "--out", "{tmp}/missing/t.jsonl"], "does not exist"),
        (["validate", "{tmp}/bad.jsonl"], "bad.jsonl:1: missing field 'problem_statement'"),
        (["validate", "{tmp}/no-commit.jsonl"], "has no commit '0000000000000000000000000000000000000000'"),
        (["validate", "{tmp}/no-image.jsonl"], "field 'image': no image at"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(calc_repo, tmp_path, args, why):
    repo, shas = calc_repo
    base = {
        "instance_id": "t",
        "problem_statement": "p",
        "repo": str(repo),
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
    }
    (tmp_path / "bad.jsonl").write_text(json.dumps({"instance_id": "t"}) + "\n")
    (tmp_path / "no-commit.jsonl").write_text(json.dumps({**base, "base_commit": "0" * 40}) + "\n")
    (tmp_path / "no-image.jsonl").write_text(
        json.dumps({**base, "base_commit": shas["initial"], "image": str(tmp_path / "no-image")}) + "\n"
    )
    before = sorted(os.listdir(tmp_path))
    run = strop("tasks", *(a.format(repo=repo, tmp=tmp_path) for a in args))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert re.search(why, run.stderr), run.stderr
    assert sorted(os.listdir(tmp_path)) == before  # nothing half-written


@pytest.mark.parametrize("which", ["partial", "report", "partial-link", "report-link"])
def test_mine_writes_nothing_that_is_not_its_own(calc_repo, tmp_path, which):
    """Beside the task file it was named, `mine` writes its journal and its report: a user's file at
    either name, or a link there, is refused before any work, and left as it was."""
    repo, _ = calc_repo
    out = tmp_path / "calc.jsonl"
    target = tmp_path / ("calc.jsonl.partial" if which.startswith("partial") else "calc.report.json")
    victim = tmp_path / "notes.txt"
    victim.write_text("my notes\n")
    if which.endswith("link"):
        target.symlink_to(victim)
    else:
        target.write_text("my notes\n")
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    run = strop("tasks", "mine", "--repo", str(repo), "--out", str(out))
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and target.name in run.stderr, run.stderr
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before
