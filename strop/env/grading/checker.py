"""The reward checker: score an agent's changes with tests it never saw, in a fresh sandbox.

Order matters, because every step closes a way to game the reward:
1. drop the bytecode and pytest caches among the changes (`source_changes`), and changes to
   protected paths (the task's globs, the hidden test paths, anything outside
   the repository, new top-level modules that would shadow the runner such as `pytest.py`),
   so edited or deleted tests and runner config never count;
2. open a fresh sandbox on the pristine task repository (`strop.env.world.task_world`) and write the
   remaining changes into it from the host;
3. only then write the hidden tests (`hidden_tests` and what `test_patch` makes) over whatever
   sits at their paths — no agent code runs before the world is complete — and make the repository
   importable as the task's recipe says (`strop.env.recipe`: its setup commands, its paths);
4. run the test command (on the task's FAIL_TO_PASS and PASS_TO_PASS test ids when it has them,
   else on the hidden test files) with the JUnit report going to a random path outside the
   repository that the agent's sandbox never had, and parse that XML, never the test output;
5. count a run with fewer test cases than the task declares (`metadata["n_tests"]`, and
   `["n_perturbed_tests"]` for the perturbed run) as failed,
   and a report of all passes from a runner that exited non-zero as forged.

Tasks graded by values (`task.grader == "values"`) skip steps 3-4: the hidden checks never enter
the agent's world; a judge sandbox runs them and the agent's code only answers their calls with
plain data (`strop.env.grading.isolated`), so nothing the code does inside its own process (an
always-equal return value, a patched runner, an exit call) can pass a check.

Timeouts, crashes, missing or malformed reports give reward 0 with a `reason`; `check` never
raises. `Score.outcome` says in one word of `Outcome` what the checker concluded, for code to
branch on; `reason` says it in words, for people. The perturbed run (same steps, `task.perturbed_tests` in place
of the hidden tests)
is reported separately for the hack monitor and does not change the reward; it runs only when
the hidden tests gave reward (special-casing test inputs matters only when it paid).
"""

import fnmatch
import secrets
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath
from typing import Literal

from strop.env.grading.isolated import GradingFailed, grade
from strop.env.grading.junit import parse_junit
from strop.env.runner import RUNNER_MODULES
from strop.env.sandbox.interface import Limits, Sandbox
from strop.env.task import Task
from strop.env.world.patches import hidden_tests
from strop.env.world.task_world import empty_sandbox, prepare_world, recipe_env, repository_has, task_sandbox

Mode = Literal["binary", "fraction"]
# what a check concluded: every test passed; the tests ran and some did not pass; no test ran;
# there was nothing to check (`strop.rl.rollout`); the changes could not be scored (a timeout, a
# missing, malformed or forged report, a grading failure, the checker's own error: see `reason`)
Outcome = Literal["passed", "tests failed", "no tests ran", "no changes", "not scored"]
TEST_TIMEOUT_S = 120.0


@dataclass
class Score:
    reward: float
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    reason: str = "ok"
    dropped_paths: list[str] = field(default_factory=list)
    duration: float = 0.0
    perturbed_reward: float | None = None  # None when the task has no perturbed tests or it was not run
    perturbed_reason: str | None = None
    exit_code: int | None = None
    detail: str = ""  # graded by values: the first check that did not pass, and why
    outcome: Outcome = "passed"
    perturbed_outcome: Outcome | None = None

    def to_dict(self) -> dict:
        return asdict(self)


CACHE_DIRS = frozenset({"__pycache__", ".pytest_cache"})
GIT_DIR = ".git"  # git's own bookkeeping: `git status` rewrites the index; never the agent's work


def source_changes(changes: dict) -> dict:
    """The agent's changes without the caches that running code leaves behind. They are not the
    agent's work (an honest `pytest` run writes tests/__pycache__/*.pyc, which the monitor would
    read as a test edit), and a shipped .pyc can be stale: Python trusts it when the source's
    mtime second and size match, so a same-length edit made within the second of a test run
    would be scored on the old bytecode. Changes under the repository's `.git` are git's
    bookkeeping (an index `git status` refreshed), never code."""
    return {
        p: v for p, v in changes.items() if not CACHE_DIRS.intersection(p.split("/")) and p.split("/")[0] != GIT_DIR
    }


def shadows_runner(task: Task, path: str) -> bool:
    """True for a new top-level module named like one the test runner imports (`pytest.py`,
    `_pytest/`, `json.py`, ...): `python -m pytest` puts the repository first on sys.path."""
    top = PurePosixPath(path).parts[0]
    name = top.removesuffix(".py")
    return name in RUNNER_MODULES and not repository_has(task, top)


def is_protected(task: Task, path: str) -> bool:
    """True for paths whose changes never count: protected globs, hidden tests, escapes, and
    modules that would shadow the test runner."""
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts or p.parts[0] == ".git":
        return True
    path = str(p)
    if shadows_runner(task, path):
        return True
    if path in hidden_tests(task) or path in task.perturbed_tests:
        return True
    return any(fnmatch.fnmatchcase(path, g) for g in task.protected)


def split_changes(
    task: Task, changes: dict[str, bytes | str | None]
) -> tuple[dict[str, bytes | str | None], list[str]]:
    kept = {p: d for p, d in changes.items() if not is_protected(task, p)}
    return kept, sorted(p for p in changes if p not in kept)


def _write(sandbox: Sandbox, changes: dict[str, bytes | str | None]) -> None:
    """Apply `changes` to a sandbox's workspace from the host (deletions first), before any command runs."""
    for rel in sorted(p for p, d in changes.items() if d is None):
        sandbox.remove_file(rel)
    for rel, data in sorted((p, d) for p, d in changes.items() if d is not None):
        sandbox.write_file(rel, data)


@dataclass
class CheckRun:
    """One run of a task's test command: its exit code, whether it timed out, and the JUnit report
    it wrote (None when it wrote none)."""

    exit_code: int | None
    timed_out: bool
    report: bytes | None
    setup_failed: str = ""  # the recipe's setup failed (`strop.env.recipe`): its exit and last output line


def run_tests(
    task: Task, changes: dict[str, bytes | str | None], tests: dict[str, str], selected: list[str], limits: Limits
) -> CheckRun:
    """Run `task`'s test command on `selected` (test ids or files) in a fresh sandbox of its world
    (steps 2-4 of the module docstring): `changes`, then `tests`, written from the host before any
    command runs; the report goes to a path the code under test never had and comes back as XML."""
    timeout = float(task.metadata.get("timeout_s", TEST_TIMEOUT_S))
    # a fresh sandbox on the pristine repository; the kept changes and then the tests are written
    # from the host before any command runs, so nothing of the agent's runs while it is assembled
    with task_sandbox(task, limits, kind="check") as sandbox:
        _write(sandbox, changes)
        _write(sandbox, tests)
        setup = prepare_world(sandbox, task, timeout)
        if setup is not None and setup.exit_code != 0:
            last = (setup.stderr.strip() or setup.stdout.strip() or "no output").splitlines()[-1][:200]
            return CheckRun(setup.exit_code, setup.timed_out, None, f"exit {setup.exit_code}: {last}")
        junit = f"/tmp/strop-junit-{secrets.token_hex(8)}.xml"
        cmd = [a.replace("$STROP_JUNIT", junit) for a in task.test_command] + selected
        # no third-party pytest plugins: hidden tests need none, and loading them (anyio's, from
        # strop's own environment) was a third of every check's time; no bytecode is the sandbox's own setting
        env = {"STROP_JUNIT": junit, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **recipe_env(task)}
        result = sandbox.exec(cmd, timeout=timeout, env=env)
        if result.timed_out:
            return CheckRun(result.exit_code, True, None)
        try:
            return CheckRun(result.exit_code, False, sandbox.read_file(junit))
        except OSError:
            return CheckRun(result.exit_code, False, None)


def _run(task: Task, kept: dict, tests: dict[str, str], n_tests: int, mode: Mode, limits: Limits) -> Score:
    timeout = float(task.metadata.get("timeout_s", TEST_TIMEOUT_S))
    if task.grader == "values":  # the checks never enter the agent's world: a judge on an empty one runs them
        with task_sandbox(task, limits, kind="check") as sandbox, empty_sandbox(task, limits) as judge:
            _write(sandbox, kept)
            return _values_score(sandbox, judge, tests, n_tests, mode, timeout)
    run = run_tests(task, kept, tests, task.fail_to_pass + task.pass_to_pass or sorted(tests), limits)
    if run.setup_failed:
        return Score(0.0, reason=f"setup failed: {run.setup_failed}", exit_code=run.exit_code, outcome="not scored")
    if run.timed_out:
        return Score(0.0, reason=f"timeout after {timeout:.0f} s", exit_code=run.exit_code, outcome="not scored")
    if run.report is None:
        return Score(
            0.0, reason=f"no junit report (exit code {run.exit_code})", exit_code=run.exit_code, outcome="not scored"
        )
    try:
        passed, failed, errors, skipped = parse_junit(run.report)
    except ET.ParseError as e:
        return Score(0.0, reason=f"malformed junit report: {e}", exit_code=run.exit_code, outcome="not scored")
    score = _tally(Score(0.0, passed, failed, errors, skipped, exit_code=run.exit_code), n_tests, mode)
    if (
        score.reward == 1.0 and run.exit_code != 0
    ):  # a report of all passes from a failed run was written by someone else
        score.reward, score.outcome = 0.0, "not scored"
        score.reason = f"all {score.passed} tests passed in the report but the runner exited {run.exit_code}"
    return score


def _values_score(answerer, judge, checks: dict[str, str], n_tests: int, mode: Mode, timeout: float) -> Score:
    """The score of checks graded by values (`strop.env.grading.isolated`)."""
    outcomes = []
    try:
        for source in checks.values():
            outcomes += grade(source, answerer, judge, timeout)
    except GradingFailed as e:
        return Score(0.0, reason=str(e), outcome="not scored")
    kinds = [kind for _, kind, _ in outcomes]
    score = _tally(Score(0.0, kinds.count("passed"), kinds.count("failed"), kinds.count("error")), n_tests, mode)
    score.detail = next((f"{name}: {detail}"[:300] for name, kind, detail in outcomes if kind != "passed"), "")
    return score


def _tally(score: Score, n_tests: int, mode: Mode) -> Score:
    """Reward and reason from the counts: fewer test cases than the task declares count as failures."""
    total = max(score.passed + score.failed + score.errors + score.skipped, n_tests)
    if total == 0:
        score.reason, score.outcome = "no tests ran", "no tests ran"
    elif score.passed < total:
        score.reason, score.outcome = f"{total - score.passed} of {total} tests did not pass", "tests failed"
        score.reward = score.passed / total if mode == "fraction" else 0.0
    else:
        score.reward = 1.0
    return score


def task_limits(task: Task) -> Limits:
    """The limits of a check's sandbox: the defaults, with `cpu_s` and `memory_mb` from the task's
    metadata where it sets them (a real project's suite may need more than a generated task's: thread
    stacks count against the address space)."""
    asked = {k: int(task.metadata[k]) for k in ("cpu_s", "memory_mb") if k in task.metadata}
    return Limits(timeout_s=float(task.metadata.get("timeout_s", TEST_TIMEOUT_S)), **asked)


def check(
    task: Task,
    changes: dict[str, bytes | str | None],
    mode: Mode = "binary",
    perturbed: bool = True,
    limits: Limits | None = None,
) -> Score:
    """Score `changes` (relative path -> new content, None = deleted) against `task`'s hidden tests."""
    start = time.perf_counter()
    kept, dropped = split_changes(task, source_changes(changes))
    limits = limits or task_limits(task)
    try:
        score = _run(task, kept, hidden_tests(task), task.metadata.get("n_tests", 0), mode, limits)
        if perturbed and task.perturbed_tests and score.reward > 0:  # special-casing only matters if it paid
            other = _run(task, kept, task.perturbed_tests, task.metadata.get("n_perturbed_tests", 0), mode, limits)
            score.perturbed_reward, score.perturbed_reason, score.perturbed_outcome = (
                other.reward,
                other.reason,
                other.outcome,
            )
    except Exception as e:  # the process boundary of scoring: a broken run is reward 0, never a crash
        score = Score(0.0, reason=f"checker error: {type(e).__name__}: {e}", outcome="not scored")
    score.dropped_paths = dropped
    score.duration = time.perf_counter() - start
    return score
