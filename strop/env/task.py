"""The Task record: what an episode starts from and how it is scored. Plain data, JSON-serialisable."""

from dataclasses import asdict, dataclass, field
from typing import Literal

from strop.env.recipe import Recipe
from strop.env.runner import PROTECTED, TEST_COMMAND


@dataclass
class Task:
    """One coding task.

    The world the agent starts in: the OS `image` (a root directory, an OCI image layout or a
    `docker save` archive, see `strop.env.world.image`; "" = the host's root) and the repository at
    WORKDIR: `repo` (a git repository, bundle or URL checked out at `base_commit`, a directory or
    a tarball; see `strop.env.world.repo`) with `files` (relative path -> text) written over it, or
    `files` alone. `gold_patch` is a reference solution as a unified diff, where known.
    `hidden_tests` are copied in by the checker only, into a fresh sandbox, after the agent is gone;
    `test_patch` (a unified diff, SWE-bench's field) adds hidden tests the same way. When
    `fail_to_pass` / `pass_to_pass` name test ids, the checker runs exactly those (reward 1 when
    all pass); else it runs the hidden test files.
    `recipe` says how the repository is made importable (paths on the import path, setup commands
    run before the tests and before the agent's first turn: `strop.env.recipe`).
    `start_patch` (a unified diff) is applied to the repository before `files`: the starting state
    of a task whose bug was injected (`strop tasks synth`), where `gold_patch` undoes it.
    `test_command` runs the hidden tests (the checker appends their paths) and writes JUnit XML to
    `$STROP_JUNIT`; the checker replaces that literal in each argument by a path the agent never had.
    `protected` are glob patterns of paths whose edits the checker drops (tests, runner config:
    `strop.env.runner.PROTECTED` by default).
    `perturbed_tests` replace `hidden_tests` in a second run that checks the same behaviour on other
    inputs: an honest solution passes both, one that special-cases the hidden inputs fails it.
    `grader` "pytest" runs the hidden tests with `test_command` in the agent's world; "values"
    means each hidden test file is a trusted check module (a `CHECKS` list of (name, function(call)))
    that a judge sandbox runs, the agent's code only answering its calls with plain data
    (`strop.env.grading.isolated`): no in-process trick of that code can pass a check.
    """

    id: str
    suite: str
    split: Literal["train", "eval"]
    instruction: str
    files: dict[str, str] = field(default_factory=dict)
    hidden_tests: dict[str, str] = field(default_factory=dict)
    test_command: list[str] = field(default_factory=lambda: list(TEST_COMMAND))
    protected: list[str] = field(default_factory=lambda: list(PROTECTED))
    metadata: dict = field(default_factory=dict)  # family, difficulty (int), source, reference_edits
    perturbed_tests: dict[str, str] = field(default_factory=dict)
    grader: Literal["pytest", "values"] = "pytest"
    image: str = ""
    repo: str = ""
    base_commit: str = ""
    test_patch: str = ""
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    gold_patch: str = ""
    recipe: Recipe = field(default_factory=Recipe)
    start_patch: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Task":
        return Task(**{**d, "recipe": Recipe.from_record(d.get("recipe", {}))})
