"""The test runner a task's tests run under, and which files of a repository are its tests.

pytest, writing a JUnit report in the xunit1 family (whose testcases carry their file, so test ids
map back to them) to `$STROP_JUNIT`, which the checker replaces by a path the code under test
never had. Which files are tests: the modules pytest collects by default (`test_*.py`,
`*_test.py`) anywhere, everything under a test directory, and `conftest.py`; which files configure
the runner: pytest's configuration files and conftest.py files, at any depth (`RUNNER_FILES`). An
agent's changes to either never count (`PROTECTED`, the default of `Task.protected`; the runner's
files whatever a task says), and the miner splits a commit with the same rule (`is_test_path`).
"""

import fnmatch
from pathlib import PurePosixPath

RUNNER = ["python3", "-m", "pytest"]
TEST_COMMAND = [*RUNNER, "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1"]
TEST_COMMAND += ["--junitxml=$STROP_JUNIT"]
TEST_MODULES = ("test_*.py", "*_test.py")  # what pytest collects by default
TEST_DIRS = ("test", "tests")  # at any depth; `testing/` only at the top (numpy.testing is library code)
TEST_GLOBS = (
    *TEST_MODULES,
    *(f"**/{g}" for g in TEST_MODULES),
    *(f"{d}/**" for d in TEST_DIRS),
    *(f"**/{d}/**" for d in TEST_DIRS),
    "testing/**",
    "conftest.py",
    "**/conftest.py",
)
# the files pytest reads its configuration from (pytest.toml and .pytest.ini since pytest 9), at any
# depth (pytest looks for them from the tests' common directory upwards), and its conftest.py files:
# they decide how the runner runs, so the checker protects them whatever a task's `protected` says
RUNNER_CONFIG = ("pytest.ini", ".pytest.ini", "pytest.toml", "pyproject.toml", "tox.ini", "setup.cfg")
RUNNER_FILES = (*RUNNER_CONFIG, *(f"**/{c}" for c in RUNNER_CONFIG), "conftest.py", "**/conftest.py")
PROTECTED = tuple(dict.fromkeys((*TEST_GLOBS, *RUNNER_FILES)))


def is_test_module(path: str) -> bool:
    """Whether pytest collects the file `path` as a test module by default."""
    return any(fnmatch.fnmatchcase(PurePosixPath(path).name, g) for g in TEST_MODULES)


def is_test_path(path: str) -> bool:
    """Whether `path` (relative to the repository) is part of its tests: a test module, a file
    under a test directory, or a conftest.py."""
    return any(fnmatch.fnmatchcase(path, g) for g in TEST_GLOBS)
