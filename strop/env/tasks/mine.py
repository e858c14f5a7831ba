"""Tasks mined from a repository's history, and the check that any task file's tasks are sound.

A commit that changes code together with its tests is a task nobody had to write: start at its
parent, ask for what its message says, and grade with its tests. `mine` walks the newest
`max_commits` non-merge commits of `rev` and splits each one's diff against its parent into a test
part (`strop.env.runner.is_test_path`) and a code part (the rest). A commit whose test part adds or
changes a test module (`test_*.py`, `*_test.py`) and whose code part changes source code (a path
that is not documentation, stubs or configuration: `NOT_CODE`) is a candidate:

- instruction = the commit message; test_patch = the test part (the hidden tests); gold patch =
  the code part; repo = the source, base_commit = the parent; image = the image mined in;
- the repository's recipe (`strop.env.recipe`: what goes on the import path, which setup commands
  run first) is detected at the commit, unless the caller gives one; the task records it;
- the tests run twice in the image, through the checker's own path (`strop.env.grading.checker.run_tests`:
  a fresh sandbox, JUnit to a path the code never had): at the parent with the test part applied,
  and with the code part too, as the checker would score it (protected paths dropped). Which tests:
  `tests="modules"`, every test of the changed test modules (SWE-bench's way); `tests="touched"`,
  those the test part adds or changes (`strop.env.tasks.touched_tests`: a handful instead of a real
  project's hundreds, so mining and every later check are many times cheaper, at the price of a
  PASS_TO_PASS that guards only the neighbourhood of the change). FAIL_TO_PASS = the tests passing
  after and not before (failed, erroring, skipped, or absent because their module did not import);
  PASS_TO_PASS = those passing in both;
- the task is then validated as `strop tasks validate` validates any task file (`validate`): the
  checker scores the gold patch (reward 1 on FAIL_TO_PASS + PASS_TO_PASS, run by id) and the parent
  fails every FAIL_TO_PASS test.

A candidate is dropped, for one `DROPS` reason: no test module among its test changes; "timeout"
(a run outlived `timeout_s`); "does not build" (at the commit the tests produce no report or not
one passing test: the code does not import, or needs what the image lacks); "no failing test" (the
tests pass at the parent already); "flaky" (the validation's rerun by test id disagrees with the
first run: a flaky test, or one that passes only after others ran).

Split, honestly held out: chronological (git log's order, which is newest first by commit date);
the newest `ceil(eval_fraction * kept)` tasks are `eval`, the rest `train`, so no eval task's fix
precedes a train task's.

Determinism: the task file and the report hold no clock time and follow the history's order, so
the same repository and image give the same bytes, whatever the number of jobs; only a test whose
outcome changes between runs can change them. Nothing is lost on failure: each commit's result is
appended to `<out>.partial` as it is known, a rerun with the same source, image and limits
reuses it, and the partial file goes when the task file and `<out>.report.json` are written. Both
are `mine`'s own: a link, or a file of another kind, at either name is refused before any work.
"""

import fnmatch
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal
from xml.etree.ElementTree import ParseError

from strop.confined import read_regular
from strop.env.grading.checker import check, run_tests, source_changes, split_changes, task_limits
from strop.env.grading.diagnosis import no_report_reason, unknown_tests_reason
from strop.env.grading.junit import junit_outcomes
from strop.env.host.node_cache import is_url
from strop.env.recipe import Recipe, detect
from strop.env.runner import RUNNER, TEST_COMMAND, is_test_module, is_test_path
from strop.env.sandbox.interface import Limits
from strop.env.task import Task
from strop.env.tasks.task_file import task_from_record, task_record
from strop.env.tasks.touched_tests import touched_tests
from strop.env.world.image import image_root
from strop.env.world.patches import gold_changes, hidden_tests
from strop.env.world.repo import checkout, git, history
from strop.env.world.task_world import empty_sandbox
from strop.errors import UserError
from strop.memo import content_key
from strop.outputs import write_atomic

# changes that no test can tell apart: documentation, type stubs, packaging and runner configuration
NOT_CODE = (
    "doc/*",
    "docs/*",
    "*.md",
    "*.rst",
    "*.txt",
    "*.pyi",
    "*.typed",
    "*.cfg",
    "*.toml",
    "*.ini",
    "*.in",
    "*.yml",
    "*.yaml",
    ".*",
    "*/.*",
    "LICENSE*",
    "Makefile",
)
Scope = Literal["modules", "touched"]
DROPS = ("no test module", "timeout", "does not build", "no failing test", "flaky")
KEPT = "kept"
# every run may import all of a real project's suite: thread stacks count against the address space
TIMEOUT_S, MEMORY_MB = 300.0, 4096
# the miner's first runs go on past a module that fails to import, so the other modules' tests
# still tell PASS_TO_PASS from FAIL_TO_PASS
_GO_ON = "--continue-on-collection-errors"


@dataclass(frozen=True)
class Commit:
    sha: str
    parent: str
    time: int  # committer time, seconds since the epoch
    tests: tuple[str, ...]  # changed paths of the test part
    code: tuple[str, ...]  # changed paths of the code part


@dataclass(frozen=True)
class Settings:
    """How a repository is mined: the source (absolute path or URL), the image (absolute path, or ""
    for the host's root), a test run's limits, and which tests run (see the module docstring)."""

    source: str
    image: str = ""
    timeout_s: float = TIMEOUT_S
    memory_mb: int = MEMORY_MB
    tests: Scope = "modules"
    recipe: Recipe | None = None  # None: detected at each commit (`strop.env.recipe.detect`)
    test_command: tuple[str, ...] = tuple(TEST_COMMAND)


@dataclass
class Verdict:
    """Whether a task is sound: its gold patch passes every hidden test and its starting repository
    fails every FAIL_TO_PASS test; `gold` and `base` say in a word what each run found, `problem` in
    one line what is wrong ("" when sound), naming the task, the field and the cause."""

    task: str
    ok: bool
    gold: str
    base: str
    problem: str = ""


def _is_code(path: str) -> bool:
    return not any(fnmatch.fnmatchcase(path, g) for g in NOT_CODE)


def candidates(mirror: Path, sha: str, max_commits: int | None) -> tuple[int, list[Commit]]:
    """(commits walked, the candidates among them): the newest `max_commits` non-merge commits of
    `sha`'s history (all without a limit) that change both tests and source code, newest first."""
    limit = [f"--max-count={max_commits}"] if max_commits else []
    lines = git("log", "--no-merges", "--format=%H %ct %P", *limit, sha, cwd=mirror).splitlines()
    found = []
    for line in lines:
        commit, time, *parents = line.split()
        if not parents:  # the root commit: nothing to start from
            continue
        names = git("diff-tree", "-r", "-z", "--name-only", "--no-renames", parents[0], commit, cwd=mirror)
        paths = sorted(p for p in names.split("\0") if p)
        tests = tuple(p for p in paths if is_test_path(p))
        code = tuple(p for p in paths if not is_test_path(p))
        if tests and any(_is_code(p) for p in code):
            found.append(Commit(commit, parents[0], int(time), tests, code))
    return len(lines), found


def _diff(mirror: Path, commit: Commit, paths: tuple[str, ...]) -> str:
    # binary files as git's binary patches (full ids: `git apply` needs them); a path is a path, not a glob
    return git(
        *("diff", "--binary", "--full-index", "--no-renames", commit.parent, commit.sha, "--", *paths),
        cwd=mirror,
        env={"GIT_LITERAL_PATHSPECS": "1"},
    )


def repo_name(source: str) -> str:
    """A repository's short name from its source (a path or URL, without .bundle or .git): task ids start with it."""
    name = Path(source.rstrip("/")).name
    for suffix in (".bundle", ".git"):
        name = name.removesuffix(suffix)
    return name or "repo"


def _task(how: Settings, mirror: Path, commit: Commit) -> Task:
    message = git("log", "-1", "--format=%B", commit.sha, cwd=mirror).strip()
    # detected where the fix leaves the repository: a commit that moves the code into src/ needs src
    recipe = how.recipe if how.recipe is not None else detect(checkout(how.source, commit.sha))
    return Task(
        id=f"{repo_name(how.source)}-{commit.sha[:12]}",
        suite="",
        split="train",
        instruction=message or f"commit {commit.sha[:12]}",
        test_command=list(how.test_command),
        recipe=replace(recipe, notes=()),
        metadata={
            "source": "mined",
            "commit": commit.sha,
            "commit_time": commit.time,
            "timeout_s": how.timeout_s,
            "cpu_s": 2 * math.ceil(how.timeout_s),  # the wall-clock timeout ends a run; this only bounds a runaway
            "memory_mb": how.memory_mb,
        },
        image=how.image,
        repo=how.source,
        base_commit=commit.parent,
        test_patch=_diff(mirror, commit, commit.tests),
        gold_patch=_diff(mirror, commit, commit.code),
    )


def _outcomes(report: bytes | None) -> dict[str, str] | None:
    if report is None:
        return None
    try:
        return junit_outcomes(report)
    except ParseError:
        return None


def _gold(task: Task) -> tuple[str, str]:
    """(table cell, problem or "") of a task's gold patch: it must pass every hidden test."""
    if not task.gold_patch:
        return "none", f"task {task.id!r}: no gold patch (field 'patch'): nothing shows its tests can pass"
    try:
        changes = gold_changes(task)
    except UserError as e:
        return "does not apply", str(e)
    score = check(task, changes, perturbed=False)
    ran = score.passed + score.failed + score.errors + score.skipped
    cell = f"{score.passed}/{ran} pass" if ran else "no tests ran"
    if score.reward == 1.0:
        return cell, ""
    if score.outcome != "tests failed":  # not the patch's fault: the reason names what is wrong
        return cell, f"task {task.id!r}: {score.reason}"
    first = f"; first failure {score.detail}" if score.detail and "memory limit" not in score.reason else ""
    return cell, f"task {task.id!r}: the gold patch (field 'patch') does not pass: {score.reason}{first}"


def _start(task: Task) -> tuple[str, str]:
    """(table cell, problem or "") of a task's starting repository: it must fail every FAIL_TO_PASS
    test (with none named, the hidden tests as a whole)."""
    if not task.fail_to_pass:  # no test ids: the whole hidden suite must fail at the start
        score = check(task, {}, perturbed=False)
        if score.reward == 0.0:
            return "fails", ""
        return "passes", f"task {task.id!r}: the starting repository passes its hidden tests already"
    limits = task_limits(task)
    run = run_tests(task, {}, hidden_tests(task), task.fail_to_pass, limits)
    n = len(task.fail_to_pass)
    if run.timed_out:
        return "timeout", f"task {task.id!r}: at the start, timeout after {limits.timeout_s:.0f} s (timeout_s)"
    outcomes = _outcomes(run.report)
    if outcomes is None:  # the code under test may crash the runner at the start: all of it failed
        return f"{n}/{n} fail", ""
    if (unknown := unknown_tests_reason(task, task.fail_to_pass, outcomes)) is not None:
        return "not scored", f"task {task.id!r}: {unknown}"
    passing = [t for t in task.fail_to_pass if outcomes.get(t) == "passed"]
    if passing:
        return (
            f"{len(passing)} of {n} pass",
            f"task {task.id!r}: {len(passing)} of {n} FAIL_TO_PASS tests pass at the start already, e.g. {passing[0]}",
        )
    return f"{n}/{n} fail", ""


def validate(task: Task) -> Verdict:
    """Check a task as `strop tasks validate` does (see `Verdict`). The task's repository and image
    must exist (a missing one raises UserError); anything else that fails is a verdict, not an error."""
    try:
        hidden_tests(task)
    except UserError as e:  # a test_patch that does not apply: this task's problem, not the file's
        return Verdict(task.id, False, "not run", "not run", str(e))
    gold, gold_problem = _gold(task)
    base, base_problem = _start(task)
    problem = gold_problem or base_problem
    return Verdict(task.id, not problem, gold, base, problem)


def check_runner(image: str, limits: Limits) -> None:
    """UserError, in the runner's own words, when the test runner does not start in `image` ("" for
    the host's root): an image without pytest would otherwise drop every commit as "does not build"."""
    with empty_sandbox(Task(id="", suite="", split="eval", instruction="", image=image), limits) as sandbox:
        run = sandbox.exec([*RUNNER, "--version"], timeout=limits.timeout_s)
    if run.exit_code != 0:
        where = f"image {image}" if image else "the host's root"
        why = no_report_reason(run.exit_code, run.stderr, limits)
        raise UserError(f"the test runner does not start in {where}: {why}")


def _mine_one(how: Settings, mirror: Path, commit: Commit) -> dict:
    """One candidate's result: {"commit", "time", "outcome" (KEPT or a DROPS reason), "detail", and
    for a kept one its task-file "record" (split not yet set; the repository path absolute)}."""
    result = {"commit": commit.sha, "time": commit.time, "outcome": "", "detail": ""}
    task = _task(how, mirror, commit)
    hidden = hidden_tests(task)
    modules = sorted(p for p in hidden if is_test_module(p))
    if not modules:
        return {**result, "outcome": "no test module", "detail": ", ".join(commit.tests)[:200]}
    first = replace(task, test_command=[*task.test_command, _GO_ON])
    limits = task_limits(task)
    kept, _ = split_changes(task, source_changes(gold_changes(task)))  # as the checker scores the gold patch
    selected = touched_tests(task.test_patch, {p: hidden[p] for p in modules}) if how.tests == "touched" else modules
    before = run_tests(first, {}, hidden, selected, limits)
    after = run_tests(first, kept, hidden, selected, limits) if not before.timed_out else before
    if before.timed_out or after.timed_out:
        where = "the parent" if before.timed_out else "the commit"
        return {**result, "outcome": "timeout", "detail": f"at {where}, after {how.timeout_s:.0f} s"}
    found = _outcomes(after.report)
    if not found or "passed" not in found.values():
        errors = sorted(t for t, k in (found or {}).items() if k != "passed")
        why = (
            f"no test passes at the commit, e.g. {errors[0]}"
            if errors
            else no_report_reason(after.exit_code, after.stderr, limits)
        )
        return {**result, "outcome": "does not build", "detail": why}
    was = _outcomes(before.report) or {}
    passing = sorted(t for t, k in found.items() if k == "passed")
    f2p = [t for t in passing if was.get(t) != "passed"]
    if not f2p:
        return {**result, "outcome": "no failing test", "detail": f"{len(passing)} tests pass at the parent too"}
    task = replace(task, fail_to_pass=f2p, pass_to_pass=[t for t in passing if was.get(t) == "passed"])
    return validated(result, task)


def validated(result: dict, task: Task) -> dict:
    """A candidate's `result` once `task` is validated as its task-file line will read it (`validate`):
    "flaky" when the rerun by id disagrees (the detail says how), else
    KEPT with its task-file "record"."""
    record = task_record(task)
    verdict = validate(task_from_record(record, task.id, Path("/"), "")[0])
    if not verdict.ok:
        return {**result, "outcome": "flaky", "detail": f"rerun by id: {verdict.problem}"}
    tests = f"{len(task.fail_to_pass)} FAIL_TO_PASS, {len(task.pass_to_pass)} PASS_TO_PASS"
    return {**result, "outcome": KEPT, "detail": tests, "record": record}


def _journal_key(how: Settings) -> str:
    """What a reused result depends on beyond its commit: the settings, the image's content (its
    cache root is named by its digest) and the test command."""
    recipe = how.recipe.to_record() if how.recipe is not None else "detected"
    what = [how.source, image_root(how.image), how.test_command, how.timeout_s, how.memory_mb, how.tests, recipe, 3]
    return content_key(json.dumps(what))


def _is_journal(path: Path, first: frozenset[str]) -> bool:
    """Whether the file `path` is a journal whose first line has the keys `first` (or is empty)."""
    data = read_regular(path, max_bytes=1 << 16)
    if not data:
        return data is not None
    line, newline, _ = data.partition(b"\n")
    if not newline:  # a first line longer than what was read (a synthesis baseline): its opening, as written
        opening = re.match(rb'\{"key": "[0-9a-f]+", "(\w+)": ', line)
        return opening is not None and {"key", opening.group(1).decode()} == first
    try:
        return set(json.loads(line)) == first
    except (ValueError, TypeError):
        return False


def _is_report(path: Path, keys: frozenset[str]) -> bool:
    """Whether the file `path` is a yield report holding the keys `keys`."""
    data = read_regular(path, max_bytes=64 << 20)
    try:
        return data is not None and keys <= set(json.loads(data))
    except (ValueError, TypeError):
        return False


JOURNAL_FIRST = frozenset({"key", "result"})  # the first line of a mining journal
REPORT_KEYS = frozenset({"commits_walked", "candidates", "kept", "dropped"})  # a mining report has these


def check_outputs(
    out: Path, command: str, journal_first: frozenset[str] = JOURNAL_FIRST, report_keys: frozenset[str] = REPORT_KEYS
) -> None:
    """UserError, before any work, unless the files `command` (`strop tasks mine`, `strop tasks synth`)
    makes beside its task file `out` are its own to write: absent, or its journal (first line with
    the keys `journal_first`) and report (with `report_keys`) from an earlier run; never a link,
    never a user's file."""
    journal, report = out.with_name(out.name + ".partial"), report_path(out)
    for path, ours, what in (
        (journal, lambda p: _is_journal(p, journal_first), "a journal"),
        (report, lambda p: _is_report(p, report_keys), "a yield report"),
    ):
        if path.is_symlink():
            raise UserError(f"{str(path)!r} is a symbolic link; `{command}` writes no file through one")
        if path.exists() and not ours(path):
            raise UserError(f"{str(path)!r} exists and is not {what} of `{command}`: move it or choose another --out")


def open_journal(path: Path):
    """The journal `path` opened for appending, never through a link (`check_outputs` refused one
    before the work began; this refuses one made since)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o644), "a")


def journal_entries(path: Path, key: str) -> list[dict]:
    """The entries of the journal `path` (JSON lines) written under `key`, in order; a line cut short
    by a kill, or written under other settings, is left out."""
    found = []
    if path.exists():
        for line in (read_regular(path) or b"").decode(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if isinstance(entry, dict) and entry.get("key") == key:
                found.append(entry)
    return found


def mine(
    source: str,
    out: Path,
    image: str = "",
    rev: str = "HEAD",
    max_commits: int | None = None,
    jobs: int = 1,
    eval_fraction: float = 0.2,
    timeout_s: float = TIMEOUT_S,
    memory_mb: int = MEMORY_MB,
    tests: Scope = "modules",
    recipe: Recipe | None = None,
    test_command: list[str] | None = None,
    progress: bool = True,
) -> dict:
    """Mine `source` (a git working copy, bare repository or bundle) into the task file `out` and
    `<out>.report.json` (see the module docstring); returns the report. `recipe` and `test_command`
    replace what is detected at each commit and the default test command."""
    from tqdm import tqdm

    out = Path(out)
    journal = out.with_name(out.name + ".partial")
    check_outputs(out, "strop tasks mine")  # as a missing or broken image, refused before any work
    image_root(image)  # and so is an image without the runner
    check_runner(image, Limits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=2 * math.ceil(timeout_s)))
    mirror, sha = history(source, rev)
    source = source if is_url(source) else str(Path(source).resolve())
    how = Settings(
        source,
        str(Path(image).resolve()) if image else "",
        timeout_s,
        memory_mb,
        tests,
        recipe,
        tuple(test_command or TEST_COMMAND),
    )
    walked, found = candidates(mirror, sha, max_commits)
    key = _journal_key(how)
    results = {e["result"]["commit"]: e["result"] for e in journal_entries(journal, key)}
    todo = [c for c in found if c.sha not in results]
    pool = ThreadPoolExecutor(max(1, jobs))
    try:
        work = [pool.submit(_mine_one, how, mirror, c) for c in todo]
        with (
            open_journal(journal) as log,
            tqdm(
                total=len(found),
                initial=len(found) - len(todo),
                desc="mining",
                unit="commit",
                dynamic_ncols=True,
                disable=not progress,
            ) as bar,
        ):
            for done in as_completed(work):
                result = done.result()
                results[result["commit"]] = result
                log.write(json.dumps({"key": key, "result": result}) + "\n")
                log.flush()
                bar.update(1)
                bar.set_postfix(kept=sum(r["outcome"] == KEPT for r in results.values()))
    finally:  # on an error or Ctrl-C, commits not started are not started
        pool.shutdown(wait=True, cancel_futures=True)
    ordered = [results[c.sha] for c in reversed(found)]  # oldest first: git log's order, reversed
    kept = [r for r in ordered if r["outcome"] == KEPT]
    n_eval = math.ceil(eval_fraction * len(kept))
    lines = []
    for i, r in enumerate(kept):
        task, _ = task_from_record(r["record"], r["commit"], Path("/"), "")
        task = replace(task, split="eval" if i >= len(kept) - n_eval else "train")
        lines.append(json.dumps(task_record(task, out.resolve().parent), sort_keys=True) + "\n")
    report = {
        "repo": source if is_url(source) else os.path.relpath(source, out.resolve().parent),
        "rev": sha,
        "image": how.image,
        "tests": tests,
        "commits_walked": walked,
        "candidates": len(found),
        "kept": len(kept),
        "train": len(kept) - n_eval,
        "eval": n_eval,
        "dropped": {reason: sum(r["outcome"] == reason for r in ordered) for reason in DROPS},
        "recipes": _recipes(r["record"] for r in kept),
        "commits": [{k: r[k] for k in ("commit", "outcome", "detail")} for r in ordered],
    }
    return write_outputs(out, lines, report, journal)


def write_outputs(out: Path, lines: list[str], report: dict, journal: Path) -> dict:
    """Write a finished run's task file `out` (its `lines`) and yield report, then drop its journal
    (what `mine` and `synth` both end with); returns the report."""
    write_atomic(out, "".join(lines))
    write_atomic(report_path(out), json.dumps(report, indent=2, sort_keys=True) + "\n")
    journal.unlink(missing_ok=True)
    return report


def _recipes(records) -> dict[str, int]:
    """How many kept tasks use each recipe (its task-file field as JSON; "{}" = nothing to do)."""
    counts: dict[str, int] = {}
    for record in records:
        key = json.dumps(record.get("recipe", {}), sort_keys=True)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def report_path(out: Path) -> Path:
    """Where `mine` writes the yield report of the task file `out`."""
    return Path(out).with_name(Path(out).name.removesuffix(".jsonl") + ".report.json")
