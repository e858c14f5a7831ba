"""The test runner a task's tests run under, and which files of a repository are its tests.

pytest, writing a JUnit report in the xunit1 family (whose testcases carry their file, so test ids
map back to them) to `$STROP_JUNIT`, which the checker replaces by a path the code under test
never had. Which files are tests: the modules pytest collects by default (`test_*.py`,
`*_test.py`) anywhere, everything under a test directory, and `conftest.py`; which files configure
the runner: pytest's configuration files at the repository's top. An agent's changes to either
never count (`PROTECTED`, the default of `Task.protected`), and the miner splits a commit with the
same rule (`is_test_path`).
"""

import fnmatch
import sys
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
# the files pytest reads its configuration from (pytest.toml and .pytest.ini since pytest 9)
RUNNER_CONFIG = ("pytest.ini", ".pytest.ini", "pytest.toml", "pyproject.toml", "tox.ini", "setup.cfg")
PROTECTED = (*TEST_GLOBS, *RUNNER_CONFIG)
# modules the runner imports: a new top-level module of one of these names in the repository
# (which `python -m pytest` puts first on sys.path) would replace it
RUNNER_MODULES = frozenset(sys.stdlib_module_names) | {
    "pytest",
    "_pytest",
    "pluggy",
    "py",
    "iniconfig",
    "packaging",
    "sitecustomize",
    "usercustomize",
    "xdist",
    "pytest_timeout",
}


def is_test_module(path: str) -> bool:
    """Whether pytest collects the file `path` as a test module by default."""
    return any(fnmatch.fnmatchcase(PurePosixPath(path).name, g) for g in TEST_MODULES)


def is_test_path(path: str) -> bool:
    """Whether `path` (relative to the repository) is part of its tests: a test module, a file
    under a test directory, or a conftest.py."""
    return any(fnmatch.fnmatchcase(path, g) for g in TEST_GLOBS)
