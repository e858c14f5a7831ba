"""The reward checker: score an agent's changes with tests it never saw, in a fresh sandbox.

Order matters, because every step closes a way to game the reward:
1. drop the bytecode and pytest caches among the changes (`source_changes`), and changes to
   protected paths: the runner's own files (pytest's configuration files and conftest.py at any
   depth, `strop.env.runner.RUNNER_FILES`, whatever the task says), the task's globs, the hidden
   test paths, anything outside the repository, and new modules named like one the image's Python
   has (`shadows_runner`: `pytest.py`, `pygments.py`, an `attr/` package, in a folder the runner
   puts on sys.path), so edited tests, runner config and stand-ins for the runner never count;
2. open a fresh sandbox on the pristine task repository (`strop.env.world.task_world`) and write the
   remaining changes into it from the host;
3. only then write the hidden tests (`hidden_tests` and what `test_patch` makes) and a fresh module
   of canary tests (`strop.env.grading.canaries`) over whatever sits at their paths — no agent code
   runs before the world is complete — and make the repository importable as the task's recipe
   says (`strop.env.recipe`: its setup commands, its paths);
4. run the test command (on the task's FAIL_TO_PASS and PASS_TO_PASS test ids when it has them,
   else on the hidden test files; the canaries last) with the JUnit report going to a random path
   outside the repository that the agent's sandbox never had, and parse that XML, never the test
   output;
5. count a run with fewer test cases than the task declares (`metadata["n_tests"]`, and
   `["n_perturbed_tests"]` for the perturbed run) as failed, and a run with passes that reports a
   canary other than failed, or none, or whose runner did not exit 1 (tests failed), as forged.

Why canaries: the hidden tests run in the process of the code they import, which reaches all of
that process (the live pytest config through `gc`, its plugins, its report file, its exit code), so
no channel out of it is one that code cannot write. What it cannot know is which of the tests
named on the command line must fail: any forgery that passes what did not pass (a pass-everything
plugin, an `atexit` rewrite of the report with `os._exit(0)`, a forged report file) passes or loses
the canaries too, and earns 0. Code that tells the canaries apart and forges only the rest, or a test
that trusts an object the code returns, is not covered here: tasks graded by values close both.

Tasks graded by values (`task.grader == "values"`) skip steps 3-4: the hidden checks never enter
the agent's world; a judge sandbox runs them and the agent's code only answers their calls with
plain data (`strop.env.grading.isolated`), so nothing the code does inside its own process (an
always-equal return value, a patched runner, an exit call) can pass a check.

Timeouts, crashes, missing or malformed reports give reward 0 with a `reason`; `check` never
raises. `Score.outcome` says in one word of `Outcome` what the checker concluded, for code to
branch on; `reason` says it in words, for people. The perturbed run (same steps,
`task.perturbed_tests` in place of the hidden tests) is reported separately for the hack monitor
and does not change the reward; it runs only when the hidden tests gave reward (special-casing
test inputs matters only when it paid).
"""

import fnmatch
import secrets
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field, replace
from pathlib import PurePosixPath
from typing import Literal

from strop.env.grading.canaries import Canaries, make_canaries, split_report, verdict
from strop.env.grading.diagnosis import memory_reason, no_report_reason, unknown_tests_reason
from strop.env.grading.isolated import GradingFailed, grade
from strop.env.grading.junit import first_failure, junit_outcomes, parse_junit
from strop.env.runner import RUNNER_FILES
from strop.env.sandbox.interface import Limits, Sandbox
from strop.env.task import Task
from strop.env.world.patches import hidden_tests
from strop.env.world.task_world import (
    empty_sandbox,
    installed_modules,
    prepare_world,
    recipe_env,
    repository_has,
    task_sandbox,
)

Mode = Literal["binary", "fraction"]
# what a check concluded: every test passed; the tests ran and some did not pass; no test ran;
# there was nothing to check (`strop.rl.rollout`); the changes could not be scored (a timeout, a
# missing, malformed or forged report, a grading failure, the checker's own error: see `reason`)
Outcome = Literal["passed", "tests failed", "no tests ran", "no changes", "not scored"]
TEST_TIMEOUT_S = 120.0
STDERR_KEPT = 4000  # characters of a test run's stderr kept to say why it failed


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
    detail: str = ""  # the first test or check that did not pass, and why
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


# modules Python imports at start-up from its path, whatever the image has
_STARTUP_MODULES = frozenset({"sitecustomize", "usercustomize"})
_MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pyd")


def _is_package(task: Task, directory: str, changes: dict | None) -> bool:
    init = f"{directory}/__init__.py"
    return repository_has(task, init) and not (changes and init in changes and changes[init] is None)


def shadows_runner(task: Task, path: str, changes: dict | None = None) -> bool:
    """True for a new module named like one the image's Python has (`pytest.py`, `pygments.py`,
    `json.py`, an `attr/` package), in a directory that is no package of the starting repository
    (its top, `src/`, any folder without an `__init__.py` there or whose `__init__.py` the
    `changes` delete): `python -m pytest`, a `pythonpath` setting or pytest's rootdir insertion put
    such a directory first on sys.path, and the module would replace the installed one for the
    runner and the tests alike."""
    parts = PurePosixPath(path).parts
    if not parts or not parts[-1].endswith(_MODULE_SUFFIXES):
        return False  # a data file is no module
    if parts[-1].split(".")[0] == "__init__":
        parts = parts[:-1]  # a package's own module: the package is what would be new
    if not parts or (len(parts) > 1 and _is_package(task, "/".join(parts[:-1]), changes)):
        return False
    if parts[-1].split(".")[0] not in installed_modules(task.image) | _STARTUP_MODULES:
        return False
    return not repository_has(task, "/".join(parts))


def is_protected(task: Task, path: str, changes: dict | None = None) -> bool:
    """True for paths whose changes never count: the runner's own files (`RUNNER_FILES`, whatever
    the task says), protected globs, hidden tests, escapes, and modules that would shadow an
    installed one (`shadows_runner`, given the whole change set)."""
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts or p.parts[0] == ".git":
        return True
    path = str(p)
    if any(fnmatch.fnmatchcase(path, g) for g in (*RUNNER_FILES, *task.protected)):
        return True
    if path in hidden_tests(task) or path in task.perturbed_tests:
        return True
    return shadows_runner(task, path, changes)


def split_changes(
    task: Task, changes: dict[str, bytes | str | None]
) -> tuple[dict[str, bytes | str | None], list[str]]:
    kept = {p: d for p, d in changes.items() if not is_protected(task, p, changes)}
    return kept, sorted(p for p in changes if p not in kept)


def _write(sandbox: Sandbox, changes: dict[str, bytes | str | None]) -> None:
    """Apply `changes` to a sandbox's workspace from the host (deletions first), before any command runs."""
    for rel in sorted(p for p, d in changes.items() if d is None):
        sandbox.remove_file(rel)
    for rel, data in sorted((p, d) for p, d in changes.items() if d is not None):
        sandbox.write_file(rel, data)


@dataclass
class CheckRun:
    """One run of a task's test command: its exit code, whether it timed out, the JUnit report it
    wrote without the canaries' testcases (None when it wrote none), the canaries' outcomes, and the
    end of its stderr (what a runner that failed last said)."""

    exit_code: int | None
    timed_out: bool
    report: bytes | None
    canaries: Canaries | None  # None: a run that grades nothing (`run_tests(..., graded=False)`)
    stderr: str = ""
    canary_outcomes: dict[str, str] = field(default_factory=dict)
    setup_failed: str = ""  # the recipe's setup failed (`strop.env.recipe`): its exit and last output line

    def forged(self) -> str:
        """ "" when the canaries say the runner was left alone, else why not (`canaries.verdict`)."""
        return verdict(self.canaries, self.canary_outcomes, self.exit_code) if self.canaries else ""


def run_tests(
    task: Task,
    changes: dict[str, bytes | str | None],
    tests: dict[str, str],
    selected: list[str],
    limits: Limits,
    graded: bool = True,
) -> CheckRun:
    """Run `task`'s test command on `selected` (test ids or files; none: what the repository
    configures) and, when the run is `graded`, a fresh canary module (`strop.env.grading.canaries`)
    in a fresh sandbox of its world (steps 2-4 of the module docstring): `changes`, then `tests` and
    the canaries, written from the host before any command runs; the report goes to a path the code
    under test never had and comes back as XML. A run that grades nothing (the traced run of a
    user's own suite) has no canaries: naming their file would narrow an empty selection to it."""
    timeout = float(task.metadata.get("timeout_s", TEST_TIMEOUT_S))
    canaries = make_canaries(selected) if graded else None
    canary_files = {canaries.path: canaries.source} if canaries else {}
    # a fresh sandbox on the pristine repository; the kept changes and then the tests are written
    # from the host before any command runs, so nothing of the agent's runs while it is assembled
    with task_sandbox(task, limits) as sandbox:
        _write(sandbox, changes)
        _write(sandbox, {**tests, **canary_files})
        setup = prepare_world(sandbox, task, timeout)
        if setup is not None and setup.exit_code != 0:
            last = (setup.stderr.strip() or setup.stdout.strip() or "no output").splitlines()[-1][:200]
            failed = f"exit {setup.exit_code}: {last}"
            return CheckRun(setup.exit_code, setup.timed_out, None, canaries, setup_failed=failed)
        junit = f"/tmp/strop-junit-{secrets.token_hex(8)}.xml"
        cmd = [a.replace("$STROP_JUNIT", junit) for a in task.test_command] + selected + list(canary_files)
        # no third-party pytest plugins: hidden tests need none, and loading them (anyio's, from
        # strop's own environment) was a third of every check's time; no bytecode is the sandbox's own setting
        env = {"STROP_JUNIT": junit, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **recipe_env(task)}
        result = sandbox.exec(cmd, timeout=timeout, env=env)
        stderr = result.stderr[-STDERR_KEPT:]
        if result.timed_out:
            return CheckRun(result.exit_code, True, None, canaries, stderr)
        try:
            report = sandbox.read_file(junit)
        except OSError:
            return CheckRun(result.exit_code, False, None, canaries, stderr)
    report, outcomes = split_report(report, canaries) if canaries else (report, {})
    return CheckRun(result.exit_code, False, report, canaries, stderr, outcomes)


def _run(task: Task, kept: dict, tests: dict[str, str], n_tests: int, mode: Mode, limits: Limits) -> Score:
    timeout = float(task.metadata.get("timeout_s", TEST_TIMEOUT_S))
    if task.grader == "values":  # the checks never enter the agent's world: a judge on an empty one runs them
        with task_sandbox(task, limits) as sandbox, empty_sandbox(task, limits) as judge:
            _write(sandbox, kept)
            return _values_score(sandbox, judge, tests, n_tests, mode, timeout, task.image)
    selected = task.fail_to_pass + task.pass_to_pass or sorted(tests)
    run = run_tests(task, kept, tests, selected, limits)
    if run.setup_failed:
        return Score(0.0, reason=f"setup failed: {run.setup_failed}", exit_code=run.exit_code, outcome="not scored")
    if run.timed_out:
        reason = f"timeout after {timeout:.0f} s (the task's timeout_s)"
        return Score(0.0, reason=reason, exit_code=run.exit_code, outcome="not scored")
    if run.report is None:
        reason = no_report_reason(run.exit_code, run.stderr, limits)
        return Score(0.0, reason=reason, exit_code=run.exit_code, outcome="not scored")
    try:
        passed, failed, errors, skipped = parse_junit(run.report)
        outcomes, failure = junit_outcomes(run.report), first_failure(run.report)
    except ET.ParseError as e:
        return Score(0.0, reason=f"malformed junit report: {e}", exit_code=run.exit_code, outcome="not scored")
    score = _tally(Score(0.0, passed, failed, errors, skipped, exit_code=run.exit_code), n_tests, mode)
    if failure is not None:
        score.detail = f"{failure[0]}: {failure[1]}"[:300]
        if (memory := memory_reason(failure[1], limits)) is not None:
            score.reason += f"; {memory} in {failure[0]}"
    if score.passed and run.forged():  # passes in a report the canaries say was not the runner's own
        # a runner the memory limit cut short mid-collection writes an INTERNALERROR report without
        # the canaries: its own words say why better than "cannot be trusted" (either way: reward 0)
        score.reward, score.outcome = 0.0, "not scored"
        score.reason = memory_reason(run.stderr, limits) or run.forged()
    elif (unknown := unknown_tests_reason(task, selected, outcomes)) is not None:
        score.reward, score.reason, score.outcome = 0.0, unknown, "not scored"
    return score


def _values_score(
    answerer, judge, checks: dict[str, str], n_tests: int, mode: Mode, timeout: float, image: str
) -> Score:
    """The score of checks graded by values (`strop.env.grading.isolated`) on the image `image`."""
    outcomes = []
    try:
        for source in checks.values():
            outcomes += grade(source, answerer, judge, timeout, image)
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


def task_limits(task: Task, base: Limits = Limits()) -> Limits:
    """The limits of a check's sandbox: `base` (the defaults, or a run's `rollout.*` limits), with the
    task's `timeout_s` (else TEST_TIMEOUT_S) and its `cpu_s` and `memory_mb` where it sets them (a real
    project's suite may need more than a generated task's: thread stacks count against the address space)."""
    asked = {k: int(task.metadata[k]) for k in ("cpu_s", "memory_mb") if k in task.metadata}
    return replace(base, timeout_s=float(task.metadata.get("timeout_s", TEST_TIMEOUT_S)), **asked)


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
