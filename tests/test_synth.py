"""Tasks synthesized from a repository's code (`strop tasks synth`): a small src/-layout repository
built here, its own tests run in real sandboxes through the checker's path; the task file validates,
starts where the bug is (and git does not show it), splits by function, resumes, and refuses bad
input in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strop.env.host.node_cache import abandoned, node_cache
from strop.env.tasks.bugs import FAMILIES
from strop.env.tasks.suites import load_suite
from strop.env.tasks.synth import synth
from strop.env.world.patches import reference_edits
from strop.env.world.repo import git
from strop.env.world.task_world import task_sandbox
from strop.errors import UserError
from tests.worldkit import image_layers, image_without_pytest, sources_outside  # noqa: F401

SHAPES = """def area(w, h):
    if w < 0 or h < 0:
        raise ValueError("negative side")
    return w * h


def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def unused(a, b):
    return a - b
"""
TESTS = """import pytest

from shapes import area, clamp


def test_area():
    assert area(2, 3) == 6


def test_area_negative():
    with pytest.raises(ValueError):
        area(-1, 2)


def test_clamp():
    assert clamp(5, 0, 3) == 3
    assert clamp(-1, 0, 3) == 0
    assert clamp(2, 0, 3) == 2
"""


def make_repo(path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    git("init", "-q", "-b", "main", cwd=path)
    git("add", "-A", cwd=path)
    git("commit", "-q", "-m", "initial", cwd=path)
    return path


def strop(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strop.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def shapes_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repos") / "shapes"
    return make_repo(root, {"src/shapes/__init__.py": SHAPES, "tests/test_shapes.py": TESTS})


def test_synth_writes_valid_tasks_whose_start_is_the_bug(shapes_repo, tmp_path):
    out = tmp_path / "shapes.jsonl"
    report = synth(
        str(shapes_repo), out, max_tasks=3, combined=1, per_function=2, eval_only=["clamp"], jobs=2, progress=False
    )
    assert report["recipe"] == {"paths": ["src"]}  # detected: a src/ layout
    assert report["tests"] == {"collected": 3, "passing": 3}
    # `unused` is run by no test: none of its sites is tried
    assert report["functions"] == 2 and report["sites_not_run"] == 5
    assert report["kept"] == 4 and report["families"]["combined"] == 1, report
    tasks = load_suite(f"jsonl:{out}")
    assert {t.split for t in tasks if t.metadata["function"] == "clamp"} == {"eval"}
    assert {t.split for t in tasks if t.metadata["function"] == "area"} == {"train"}
    for t in tasks:
        assert t.fail_to_pass and set(t.fail_to_pass) <= {
            f"tests/test_shapes.py::test_{n}" for n in ("area", "area_negative", "clamp")
        }
        assert t.recipe.paths == ("src",) and t.metadata["source"] == "synthesized"
        assert t.metadata["difficulty"] == t.metadata["sites"] == (2 if t.metadata["family"] == "combined" else 1)
        assert t.metadata["distance"] == 1 and t.metadata["function_lines"] in (4, 6)
        assert t.fail_to_pass[0] in t.instruction and "Find the bug" in t.instruction
        # the agent starts with the bug, committed: git shows it no change to undo
        with task_sandbox(t) as sandbox:
            text = sandbox.read_file("src/shapes/__init__.py").decode()
            assert text != SHAPES
            status = sandbox.exec("git status --porcelain && git diff")
            assert status.exit_code == 0 and status.stdout == "", status
        edit = reference_edits(t)[0]
        assert text.replace(edit["old"], edit["new"]) == SHAPES  # the gold patch undoes it
    run = strop("tasks", "validate", str(out), "--jobs", "2")
    assert run.returncode == 0 and "4 of 4 tasks valid" in run.stdout, run.stdout + run.stderr


def test_statement_detail_and_families(shapes_repo, tmp_path):
    out = tmp_path / "names.jsonl"
    report = synth(
        str(shapes_repo),
        out,
        max_tasks=1,
        combined=0,
        families=("arithmetic",),
        detail="names",
        progress=False,
    )
    assert set(report["families"]) == {"arithmetic"} and report["kept"] == 1
    (task,) = load_suite(f"jsonl:{out}")
    assert task.instruction.splitlines()[-1].startswith("- tests/test_shapes.py::test_")
    assert "assert" not in task.instruction  # names only: no failure output


@pytest.mark.parametrize(
    "files, args, why",
    [
        ({"m.py": "def f():\n    return 1\n"}, [], "no test ran .*no tests collected"),
        (
            {"m.py": "def f():\n    return 1\n", "tests/test_m.py": "import nowhere\n\n\ndef test_f():\n    pass\n"},
            [],
            "no test passes .* tests/test_m.py: error",
        ),
        (
            {"m.py": "X = 1\n", "tests/test_m.py": "from m import X\n\n\ndef test_x():\n    assert X == 1\n"},
            [],
            "no function",
        ),
        ({"m.py": "def f():\n    return 1\n"}, ["--rev", "no-such-ref"], "has no commit 'no-such-ref'"),
        ({"m.py": "def f():\n    return 1\n"}, ["--families", "typo"], "unknown bug family 'typo'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, files, args, why):
    repo = make_repo(tmp_path / "repo", files)
    out = tmp_path / "out"
    out.mkdir()
    run = strop("tasks", "synth", "--repo", str(repo), "--out", str(out / "t.jsonl"), *args)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert __import__("re").search(why, run.stderr), run.stderr
    assert os.listdir(out) == []  # no task file, no report, no journal
    for kind in ("repos", "git"):  # nothing half-written in the cache
        # other pytest workers share the cache: a build of theirs in progress is not this run's
        left = [p for p in (node_cache() / kind).glob(".*") if not p.name.endswith(".lock")]
        assert not [p for p in left if not p.name.startswith(".build-") or abandoned(p)]


def test_an_image_without_the_test_runner_is_one_line(shapes_repo, image_without_pytest, tmp_path):
    run = strop(
        "tasks",
        "synth",
        "--repo",
        str(shapes_repo),
        "--image",
        image_without_pytest,
        "--out",
        str(tmp_path / "t.jsonl"),
    )
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "the test runner does not start in image" in run.stderr, run.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("beside", ["t.jsonl.partial", "t.report.json"])
def test_the_files_beside_the_task_file_are_never_a_users(shapes_repo, tmp_path, beside):
    """Like `tasks mine`: no write through a link at OUT.partial / OUT.report.json, nor over a user's file."""
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's own\n")
    (tmp_path / beside).symlink_to(mine)
    run = strop("tasks", "synth", "--repo", str(shapes_repo), "--out", str(tmp_path / "t.jsonl"))
    assert run.returncode == 2 and "is a symbolic link" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    (tmp_path / beside).unlink()
    (tmp_path / beside).write_text("the user's own\n")
    run = strop("tasks", "synth", "--repo", str(shapes_repo), "--out", str(tmp_path / "t.jsonl"))
    assert run.returncode == 2 and "is not a" in run.stderr and "strop tasks synth" in run.stderr, run.stderr
    assert mine.read_text() == (tmp_path / beside).read_text() == "the user's own\n"
    assert sorted(os.listdir(tmp_path)) == sorted(["mine.txt", beside])


def test_a_journal_whose_baseline_is_long_is_its_own(tmp_path):
    """A real project's baseline (its first line) outgrows what the check reads: it is still synth's."""
    from strop.env.tasks.mine import check_outputs
    from strop.env.tasks.synth import JOURNAL_FIRST, REPORT_KEYS

    journal = tmp_path / "t.jsonl.partial"
    journal.write_text(
        json.dumps({"key": "3fc33b50", "baseline": {"passing": {f"t{i}": 0.1 for i in range(20000)}}}) + "\n"
    )
    check_outputs(tmp_path / "t.jsonl", "strop tasks synth", JOURNAL_FIRST, REPORT_KEYS)  # no error
    with pytest.raises(UserError, match="is not a journal of `strop tasks mine`"):
        check_outputs(tmp_path / "t.jsonl", "strop tasks mine")


def test_candidates_of_functions_with_slow_tests_come_last():
    """A function whose tests took minutes makes each of its candidates cost minutes: they are tried
    after every other function's, which still go round the functions."""
    from strop.env.tasks.bugs import bugs
    from strop.env.tasks.probe import Baseline
    from strop.env.tasks.synth import SLOW_S, single_candidates

    texts = {"shapes.py": SHAPES}
    lines = {b.function: b.code[1] for b in bugs("shapes.py", SHAPES)}
    passing = {"t::fast": 0.1, "t::slow": SLOW_S + 1}
    runs = {("shapes.py", lines["area"]): {"t::slow": 1}, ("shapes.py", lines["clamp"]): {"t::fast": 1}}
    base = Baseline(["shapes.py"], 2, passing, runs)
    order, found = single_candidates(texts, base, FAMILIES, 3, 0, lambda bug: "train")
    assert [c.parts[0].function for c in order] == ["clamp"] * 3 + ["area"] * 3
    assert found["slow_functions"] == 1 and found["functions"] == 2


def test_the_report_says_what_was_tried(shapes_repo, tmp_path):
    out = tmp_path / "r.jsonl"
    report = synth(str(shapes_repo), out, max_tasks=2, combined=0, progress=False)
    assert report == json.loads((tmp_path / "r.report.json").read_text())
    assert report["tried"] == len(report["candidates_tried"]) >= 2
    assert sum(report["dropped"].values()) + report["kept"] == report["tried"]
    assert report["reused"] == 0 and report["run"] >= report["tried"]  # a first sitting runs all it tries
