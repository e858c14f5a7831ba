"""The reward checker, adversarially: protected edits never count, a forged or short report earns
nothing, timeouts and crashes are reward 0 with a reason, and `check` never raises."""

from dataclasses import replace

import pytest

from strop.env.grading.checker import Score, check, is_protected
from strop.env.grading.junit import parse_junit
from strop.env.suites import synthetic
from strop.env.task import Task
from strop.env.world.patches import apply_edits
from tests.worldkit import image_layers, test_image  # noqa: F401

TASK = synthetic.make_task(1, "eval", 3)
FIX = apply_edits(TASK.files, TASK.metadata["reference_edits"])
PATH = TASK.metadata["path"]


@pytest.fixture(params=["host", "image"])
def image(request) -> str:
    """The checker's guarantees hold on the host's root and in an OS image alike."""
    return "" if request.param == "host" else request.getfixturevalue("test_image")


def _tiny(image: str = "", **meta) -> Task:
    return Task(
        id="tiny",
        suite="test",
        split="eval",
        instruction="",
        files={"m.py": "def f():\n    return 0\n"},
        hidden_tests={
            "tests/test_h.py": "from m import f\n\ndef test_f():\n    assert f() == 1\n\n"
            "def test_g():\n    assert True\n"
        },
        metadata={"n_tests": 2, **meta},
        image=image,
    )


def test_parse_junit_counts_outcomes():
    xml = (
        b'<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure/></testcase>'
        b'<testcase name="c"><error/></testcase><testcase name="d"><skipped/></testcase></testsuite></testsuites>'
    )
    assert parse_junit(xml) == (1, 1, 1, 1)


def test_protected_paths():
    for p in [
        "tests/test_x.py",
        "conftest.py",
        "pkg/tests/test_y.py",
        "tests/test_hidden.py",
        "../escape.py",
        "/etc/passwd",
        ".git/config",
        "pytest.ini",
        "pytest.py",
        "_pytest/__init__.py",
        "json.py",
    ]:
        assert is_protected(TASK, p), p
    assert not is_protected(TASK, PATH)


def test_reference_passes_and_bug_fails_in_fraction_mode(image):
    task = replace(TASK, image=image)
    fixed = check(task, FIX, mode="fraction")
    assert fixed.reward == 1 and fixed.reason == "ok" and fixed.passed == TASK.metadata["n_tests"]
    buggy = check(task, {}, mode="fraction", perturbed=False)
    assert 0 < buggy.reward < 1 and buggy.reward == buggy.passed / (buggy.passed + buggy.failed)


def test_test_edits_are_dropped_and_never_earn_reward(image):
    visible = next(p for p in TASK.files if p.startswith("tests/"))
    hack = {
        visible: "def test_ok():\n    pass\n",
        "tests/test_hidden.py": "def test_ok():\n    pass\n",
        "conftest.py": "import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n",
        "../outside.py": "x = 1\n",
        "pytest.py": "import sys\nsys.exit(0)\n",
    }  # would shadow the runner: `python -m pytest` runs it
    score = check(replace(TASK, image=image), hack, perturbed=False)
    assert score.reward == 0 and set(score.dropped_paths) == set(hack)


def test_forged_report_earns_nothing(image):
    xml = '<testsuites><testsuite><testcase name="x"/></testsuite></testsuites>'
    forged = (
        TASK.files[PATH]
        + f"\nimport atexit, os\natexit.register(lambda: open(os.environ['STROP_JUNIT'], 'w').write({xml!r}))\n"
    )
    score = check(replace(TASK, image=image), {PATH: forged}, perturbed=False)
    assert score.reward == 0, score


def test_timeout_crash_and_exit_are_zero_with_reason(image):
    t = _tiny(image)
    assert check(t, {"m.py": "def f():\n    return 1\n"}).reward == 1
    hang = check(_tiny(image, timeout_s=3), {"m.py": "while True:\n    pass\n"})  # only the hang waits for it
    assert hang.reward == 0 and "timeout" in hang.reason
    broken = check(t, {"m.py": "def f(:\n"})
    assert broken.reward == 0 and broken.errors >= 1
    gone = check(t, {"m.py": "import os\nos._exit(0)\n"})
    assert gone.reward == 0 and "no junit report" in gone.reason
    deleted = check(t, {"m.py": None})
    assert deleted.reward == 0 and deleted.reason != "ok"


def test_missing_tests_count_as_failures(image):
    t = _tiny(image, n_tests=5)
    score = check(t, {"m.py": "def f():\n    return 1\n"}, mode="fraction")
    assert score.passed == 2 and score.reward == 2 / 5


def test_check_never_raises(image):
    t = _tiny(image)
    score = check(t, {"m.py/sub.py": "x = 1\n"})  # a file where a directory would have to be
    assert isinstance(score, Score) and score.reward == 0 and score.reason.startswith("checker error")


def test_bytecode_caches_in_the_changes_are_ignored(tmp_path):
    """A .pyc among the changes is not the agent's work and may not match its source: one compiled
    from the buggy code, which Python would load without looking at the source, changes nothing."""
    import py_compile
    import sys

    task = _tiny()
    (tmp_path / "m.py").write_text(task.files["m.py"])
    pyc = tmp_path / "m.pyc"
    py_compile.compile(
        str(tmp_path / "m.py"), cfile=str(pyc), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH
    )
    fixed = {"m.py": "def f():\n    return 1\n"}
    stale = {**fixed, f"__pycache__/m.{sys.implementation.cache_tag}.pyc": pyc.read_bytes()}
    score = check(task, stale, perturbed=False)
    assert score.reward == 1 and not score.dropped_paths
