"""The Task record: what an episode starts from and how it is scored. Plain data, JSON-serialisable."""

from dataclasses import asdict, dataclass, field
from typing import Literal


@dataclass
class Task:
    """One coding task.

    `files` is the repository exactly as the agent sees it at the start (relative path -> text).
    `hidden_tests` are copied in by the checker only, into a fresh sandbox, after the agent is gone.
    `test_command` runs the hidden tests (the checker appends their paths) and writes JUnit XML to
    `$STROP_JUNIT`; the checker replaces that literal in each argument by a path the agent never had.
    `protected` are glob patterns of paths whose edits the checker drops (tests, runner config).
    `perturbed_tests` replace `hidden_tests` in a second run that checks the same behaviour on other
    inputs: an honest solution passes both, one that special-cases the hidden inputs fails it.
    `grader` "pytest" runs the hidden tests with `test_command` in the agent's world; "values"
    means each hidden test file is a trusted check module (a `CHECKS` list of (name, function(call)))
    that a judge sandbox runs, the agent's code only answering its calls with plain data
    (`strop.env.isolated_grading`): no in-process trick of that code can pass a check.
    """

    id: str
    suite: str
    split: Literal["train", "eval"]
    instruction: str
    files: dict[str, str]
    hidden_tests: dict[str, str]
    test_command: list[str] = field(
        default_factory=lambda: ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=$STROP_JUNIT"]
    )
    protected: list[str] = field(
        default_factory=lambda: [
            "test_*.py",
            "tests/**",
            "**/test_*.py",
            "conftest.py",
            "**/conftest.py",
            "pytest.ini",
            "setup.cfg",
            "tox.ini",
            "pyproject.toml",
        ]
    )
    metadata: dict = field(default_factory=dict)  # family, difficulty (int), source, reference_edits
    perturbed_tests: dict[str, str] = field(default_factory=dict)
    grader: Literal["pytest", "values"] = "pytest"

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Task":
        return Task(**d)
