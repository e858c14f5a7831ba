"""Grading no tested code can forge: in a repository world, on the host's root and in an OS image,
the code the hidden tests import forges their outcome every way the probe found (a pass-everything
plugin on the live pytest config, an exit handler that rewrites the report and exits 0, a forged
report file, a module standing in for one the runner imports, the runner's own configuration) and
earns 0, while the gold patch still earns 1."""

import pytest

from strop.env.grading.canaries import make_canaries, split_report, verdict
from strop.env.grading.checker import check, is_protected
from strop.env.task import Task
from strop.env.world.patches import gold_changes
from tests.worldkit import calc_repo, git, image_layers, test_image  # noqa: F401

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"

PLUGIN = """
import gc

import pytest


class _PassEverything:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        report.outcome, report.longrepr = "passed", None


for _o in gc.get_objects():
    if type(_o).__name__ == "Config" and hasattr(_o, "pluginmanager"):
        _o.pluginmanager.register(_PassEverything())
"""

REWRITE_AT_EXIT = """
import atexit, os, re, sys


def _forge():
    path = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml="))
    xml = open(path).read()
    xml = re.sub(r"<(failure|error)\\b.*?(</\\1>|/>)", "", xml, flags=re.S)
    open(path, "w").write(xml.replace('failures="', 'failures="0" x="').replace('errors="', 'errors="0" y="'))
    os._exit(0)


atexit.register(_forge)
"""

FORGED_REPORT = """
import os, sys

_cases = "".join(
    f'<testcase classname="{a.split("::")[0][:-3].replace("/", ".")}" name="{a.split("::")[-1]}" />'
    for a in sys.argv[1:] if a.endswith(".py") or "::" in a
)
open(os.environ["STROP_JUNIT"], "w").write(f"<testsuites><testsuite>{_cases}</testsuite></testsuites>")
os._exit(0)
"""


@pytest.fixture(params=["host", "image"])
def image(request) -> str:
    return "" if request.param == "host" else request.getfixturevalue("test_image")


@pytest.fixture
def repo_task(calc_repo, image) -> Task:
    """The calc repository at its first commit: fix `add`, graded by the commit's test of it."""
    repo, shas = calc_repo
    diff = lambda *paths: git("diff", "--binary", shas["initial"], shas["fix_add"], "--", *paths, cwd=repo)  # noqa: E731
    return Task(
        id="calc-add",
        suite="test",
        split="eval",
        instruction="add subtracts",
        repo=str(repo),
        base_commit=shas["initial"],
        test_patch=diff("tests"),
        gold_patch=diff("calc.py"),
        fail_to_pass=["tests/test_calc.py::test_add"],
        pass_to_pass=["tests/test_calc.py::test_mul"],
        metadata={"n_tests": 2, "timeout_s": 60},
        image=image,
    )


@pytest.mark.parametrize(
    "forgery, dropped",
    [
        ({"calc.py": BUGGY + PLUGIN}, []),
        ({"calc.py": BUGGY + REWRITE_AT_EXIT}, []),
        ({"calc.py": BUGGY + FORGED_REPORT}, []),
        # stand-ins for what the runner imports: imported by it where it is, wherever the tests are
        (
            {"pygments.py": PLUGIN + REWRITE_AT_EXIT, "_pytest/__init__.py": REWRITE_AT_EXIT},
            ["pygments.py", "_pytest/__init__.py"],
        ),
        # the runner's own configuration, loading a plugin of the agent's, at the top and deeper
        (
            {
                ".pytest.ini": "[pytest]\naddopts = -p forge\n",
                "pytest.toml": '[pytest]\naddopts = ["-p", "forge"]\n',
                "tests/pytest.ini": "[pytest]\naddopts = -p forge\n",
                "test/helpers.py": "X = 1\n",  # a singular test folder backs the tests too
                "forge.py": PLUGIN,
            },
            [".pytest.ini", "pytest.toml", "tests/pytest.ini", "test/helpers.py"],
        ),
    ],
    ids=["gc-plugin", "atexit-rewrite", "forged-report", "shadows", "runner-config"],
)
def test_each_forgery_earns_nothing(repo_task, forgery, dropped):
    score = check(repo_task, forgery, perturbed=False)
    assert score.reward == 0 and set(dropped) <= set(score.dropped_paths), score


def test_forgeries_over_the_fix_are_seen_and_the_gold_patch_earns_one(repo_task):
    gold = gold_changes(repo_task)
    score = check(repo_task, gold, perturbed=False)
    assert score.reward == 1 and score.passed == 2 and score.reason == "ok", score
    for forgery in (PLUGIN, REWRITE_AT_EXIT, FORGED_REPORT):
        forged = check(repo_task, {"calc.py": gold["calc.py"].decode() + forgery}, perturbed=False)
        assert forged.reward == 0 and forged.outcome == "not scored", forged
        assert "canary" in forged.reason or "exited" in forged.reason, forged


def test_the_runners_files_and_stand_ins_are_protected_whatever_the_task_says(repo_task):
    task = Task(**{**repo_task.to_dict(), "protected": []})
    for path in (
        ".pytest.ini",
        "pytest.toml",
        "src/pkg/pytest.ini",
        "pkg/setup.cfg",
        "deep/conftest.py",
        "pygments.py",
        "pygments/__init__.py",
        "src/pytest.py",
        "json.py",
        "sitecustomize.py",
    ):
        assert is_protected(task, path), path
    for path in ("calc.py", "newmod.py", "data/json.txt", "pygments/lexer.py"):
        assert not is_protected(task, path), path
    assert is_protected(repo_task, "test/helpers.py")  # a singular test folder backs the tests too


def test_the_canaries_run_whatever_the_repository_configures():
    """A repository whose pytest config names tests otherwise and stops at the first failure
    (`-x`): the canaries are collected all the same, run last, and the fix earns 1."""
    task = Task(
        id="cfg",
        suite="test",
        split="eval",
        instruction="",
        files={
            "pytest.ini": "[pytest]\npython_functions = check_*\npython_classes = Check\naddopts = -x\n",
            "m.py": "def f():\n    return 0\n",
        },
        hidden_tests={"tests/test_h.py": "from m import f\n\n\ndef check_f():\n    assert f() == 1\n"},
        metadata={"n_tests": 1},
    )
    assert check(task, {"m.py": "def f():\n    return 1\n"}, perturbed=False).reward == 1
    assert check(task, {}, perturbed=False).reward == 0


def test_a_report_is_split_from_its_canaries():
    canaries = make_canaries(["tests/test_calc.py::test_add"])
    module = canaries.path.removesuffix(".py").replace("/", ".")
    cases = "".join(
        f'<testcase classname="{module}.TestX" name="{n}"><failure message="x"/></testcase>' for n in canaries.names
    )
    real = '<testcase classname="tests.test_calc" name="test_add"/>'
    xml = f"<testsuites><testsuite>{real}{cases}</testsuite></testsuites>"
    report, outcomes = split_report(xml.encode(), canaries)
    assert b"TestX" not in report and b"test_add" in report
    assert verdict(canaries, outcomes, 1) == ""
    assert "exited 0" in verdict(canaries, outcomes, 0)
    assert "not reported" in verdict(canaries, {}, 1)
    assert "passed" in verdict(canaries, dict.fromkeys(canaries.names, "passed"), 1)
