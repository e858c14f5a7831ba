"""Tasks synthesized from a repository's code: bugs injected into its own functions that its own tests
catch, each validated in the user's image exactly as the checker will score it.

History is thin (most commits are not fixes with tests); code is not. `synth` takes a repository at
one commit and:

1. reads its recipe (`strop.env.recipe`: detected, or given) and runs its whole test suite once,
   through the checker's own path, with the probe (`strop.env.tasks.probe`): which tests pass, and
   which source functions each passing test runs, at which distance (a limit of `BASELINE_TIMES`
   times `timeout_s`: the whole suite, slowed by the tracing). No test, no passing test: a
   `UserError` (one line), before anything is written;
2. lists every bug of the chosen families (`strop.env.tasks.bugs`) in the functions of its source
   files (not tests, not documentation), keeps those in code some passing test runs, and orders them
   with a seeded shuffle that goes round the functions (then round the families inside each), at
   most `per_function` each, so that a run stopped early (`max_tasks`) still spreads over functions
   and families; the functions whose tests took more than `SLOW_S` seconds (traced) come after all
   others (on more-itertools, 19 of 254, run by tests of 11 s to 3 min: every candidate there costs
   minutes);
3. validates each, in that order: the bug becomes the task's `start_patch` (the repository at
   `base_commit` with the bug is where the agent starts; the diff undoing it is the gold `patch`);
   the tests that ran the buggy function run, by id, in a fresh sandbox of the image
   (`strop.env.grading.checker.run_tests`; only those: a test that never ran the function passes
   as before, see the probe). FAIL_TO_PASS = those that no longer pass; PASS_TO_PASS = the others.
   Then the task is validated as `strop tasks validate` validates any task file
   (`strop.env.tasks.mine.validate`: the checker gives the gold patch reward 1, the start fails
   every FAIL_TO_PASS by id), which drops what a rerun does not confirm as flaky;
4. combines 2 or 3 validated bugs of one function (or module, `combine_in`) into harder tasks,
   validated the same way;
5. writes the task file (the same format as `tasks mine`: `strop.env.tasks.task_file`) and
   `<out>.report.json`.

Each task: instruction = the problem statement (`strop.env.tasks.statement`, at `detail`), id =
`<repo>-<family>-<hash>`, metadata: family (and `families` of a combined one), function, path,
line, sites, function_lines, distance (the fewest source frames from a FAIL_TO_PASS test down to the
buggy function: 1 = the test calls it), and `difficulty` = the number of sites (1 to 3).

The agent sees the repository's tests as they are (they are the user's own; the statement names
the failing ones); they are protected, so editing them changes nothing, and the checker runs the
FAIL_TO_PASS and PASS_TO_PASS tests by id on the pristine test files.

Held out by construction: the split is by function (`split_by="module"`: by source file), a
function's hash deciding (`eval_fraction`), or by name (`eval_only`: functions or modules the user
lists, all others train); a combined bug stays inside one function (module), so no eval bug sits in
code a training task touches.

Dropped, for one `DROPS` reason: "no failing test" (the tests that run the function still pass: an
equivalent change, or a gap in the tests), "timeout" (the buggy code outlived the run's limit: an
endless loop; the limit is the tests' traced time times 3 plus `QUICK_S`, at most `timeout_s`:
the traced time already overstates a plain run's, and a margin of seconds covers the runner's start), "crash"
(no report: the run died), "flaky" (the validation's rerun by id disagreed).

Deterministic (the task file and the report hold no clock time; the same repository, commit,
image and options give the same bytes whatever `jobs`; only a test whose output changes between
runs can change them) and resumable: the baseline and each candidate's result go to `<out>.partial`
as they are known; a rerun with the same settings reuses them.
"""

import difflib
import hashlib
import itertools
import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from random import Random
from typing import Callable, Iterator, Literal
from xml.etree.ElementTree import ParseError

from strop.env.grading.checker import run_tests, task_limits
from strop.env.grading.junit import JunitCase, junit_cases
from strop.env.host.node_cache import is_url
from strop.env.recipe import Recipe, detect
from strop.env.runner import TEST_COMMAND
from strop.env.sandbox.interface import Limits
from strop.env.task import Task
from strop.env.tasks import bugs as bug_families
from strop.env.tasks import probe
from strop.env.tasks.bugs import Bug, combine, function_lines, sound
from strop.env.tasks.mine import (
    check_outputs,
    check_runner,
    journal_entries,
    open_journal,
    repo_name,
    validated,
    write_outputs,
)
from strop.env.tasks.probe import Baseline
from strop.env.tasks.statement import Detail, statement
from strop.env.tasks.task_file import task_from_record, task_record
from strop.env.world.image import image_root
from strop.env.world.repo import checkout, history
from strop.errors import UserError
from strop.memo import content_key

DROPS = ("no failing test", "timeout", "crash", "flaky")
KEPT = "kept"
TIMEOUT_S, MEMORY_MB = 120.0, 4096
SLOW_S = 10.0  # a function whose tests took longer, traced, has its candidates tried after all others
QUICK_S = 10.0  # an endless loop is told from a slow run in this margin over the tests' traced time
BASELINE_TIMES = 10  # the traced run of the whole suite may take this many times one test run's limit
SplitBy = Literal["function", "module"]
JOURNAL_FIRST = frozenset({"key", "baseline"})  # the first line of a synthesis journal
REPORT_KEYS = frozenset({"candidates", "tried", "kept", "dropped", "tried_by_family"})  # a synthesis report has these
_NOT_REPORTED = JunitCase("error", message="not in the report: its module did not import")


@dataclass(frozen=True)
class Settings:
    """What a synthesis depends on beyond the candidates: where (source, commit, image), how the
    tests run (recipe, test command, limits) and what a task says (statement detail)."""

    source: str
    commit: str
    image: str
    recipe: Recipe
    test_command: tuple[str, ...]
    timeout_s: float
    memory_mb: int
    detail: Detail


@dataclass(frozen=True)
class Candidate:
    id: str
    parts: tuple[Bug, ...]  # one bug, or the 2-3 validated ones a combined bug is made of
    split: str

    @property
    def family(self) -> str:
        return self.parts[0].family if len(self.parts) == 1 else "combined"


def file_diff(path: str, before: str, after: str) -> str:
    """A unified diff (git's form) turning the text `before` of `path` into `after`."""
    lines = []
    for line in difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}", n=3):
        lines.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


def _base_task(how: Settings, name: str) -> Task:
    return Task(
        id=name,
        suite="",
        split="train",
        instruction="",
        repo=how.source,
        base_commit=how.commit,
        image=how.image,
        recipe=how.recipe,
        test_command=list(how.test_command),
        metadata={
            "timeout_s": how.timeout_s,
            "cpu_s": 2 * math.ceil(how.timeout_s),  # the wall-clock timeout ends a run; this bounds a runaway
            "memory_mb": how.memory_mb,
        },
    )


def run_baseline(how: Settings, tree: Path) -> Baseline:
    """The whole suite once with the probe (step 1 of the module docstring)."""
    limit = BASELINE_TIMES * how.timeout_s  # the whole suite, traced, against one test run's limit
    task = _base_task(how, "baseline")
    task = replace(task, metadata={**task.metadata, "timeout_s": limit, "cpu_s": 2 * math.ceil(limit)})
    return probe.trace(task, probe.source_files(tree))


def split_of(bug: Bug, split_by: SplitBy, eval_fraction: float, eval_only: list[str] | None) -> str:
    """Which split the function (or module) holding `bug` is in; see the module docstring."""
    module = bug.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    if eval_only is not None:
        names = {bug.path, module, bug.function, bug.function.rsplit(".", 1)[-1], f"{bug.path}::{bug.function}"}
        held = any(n in names or module.endswith("." + n) for n in eval_only)
        return "eval" if held else "train"
    unit = bug.path if split_by == "module" else f"{bug.path}::{bug.function}"
    h = int(hashlib.sha256(unit.encode()).hexdigest()[:8], 16)
    return "eval" if h % 10_000 < eval_fraction * 10_000 else "train"


def _candidate_id(parts: tuple[Bug, ...]) -> str:
    what = json.dumps([[b.path, b.family, [[e.start, e.end, e.new] for e in b.edits]] for b in parts])
    return hashlib.sha256(what.encode()).hexdigest()[:10]


def _round_robin(groups: list[list]) -> Iterator:
    for row in itertools.zip_longest(*groups):
        yield from (x for x in row if x is not None)


def single_candidates(
    texts: dict[str, str],
    base: Baseline,
    families: tuple[str, ...],
    per_function: int,
    seed: int,
    split: Callable[[Bug], str],
) -> tuple[list[Candidate], dict]:
    """The single-bug candidates in validation order (step 2 of the module docstring), and counts of
    what was found: sites, sites in code no passing test runs, functions."""
    by_function: dict[tuple[str, str], dict[str, list[Bug]]] = {}
    sites = unrun = 0
    for path, text in texts.items():
        for bug in bug_families.bugs(path, text):
            if bug.family not in families:
                continue
            sites += 1
            if (path, bug.code[1]) not in base.runs:
                unrun += 1
                continue
            by_function.setdefault((path, bug.function), {}).setdefault(bug.family, []).append(bug)
    rng = Random(seed)
    order = []
    for key in sorted(by_function):
        per_family = [by_function[key][f] for f in sorted(by_function[key])]
        for bugs in per_family:
            rng.shuffle(bugs)
        rng.shuffle(per_family)
        chosen = list(itertools.islice((b for b in _round_robin(per_family) if sound(b, texts[b.path])), per_function))
        order.append([Candidate(_candidate_id((b,)), (b,), split(b)) for b in chosen])
    rng.shuffle(order)
    # a function whose tests take minutes makes every candidate of it cost minutes: those come last
    is_slow = [bool(o) and _traced_s(base, o[0]) > SLOW_S for o in order]
    slow = [o for o, s in zip(order, is_slow) if s]
    fast = [o for o, s in zip(order, is_slow) if not s]
    found = {"sites": sites, "sites_not_run": unrun, "functions": len(by_function), "slow_functions": len(slow)}
    return list(_round_robin(fast)) + list(_round_robin(slow)), found


def _traced_s(base: Baseline, c: "Candidate") -> float:
    """Seconds the baseline's tests that run `c`'s function took, traced."""
    bug = c.parts[0]
    return sum(base.passing[t] for t in base.runs[(bug.path, bug.code[1])])


def combined_candidates(
    kept: list[Candidate], texts: dict[str, str], combine_in: SplitBy, per_group: int, seed: int
) -> list[Candidate]:
    """Candidates made of 2 or 3 validated bugs of one function (or one module of one split), in a
    seeded order going round the groups, at most `per_group` each."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in kept:
        bug = c.parts[0]
        key = (bug.path, bug.function) if combine_in == "function" else (bug.path, c.split)
        groups.setdefault(key, []).append(c)
    rng = Random(seed + 1)
    order = []
    for key in sorted(groups):
        members = groups[key]
        combos = [s for n in (2, 3) for s in itertools.combinations(members, n)]
        rng.shuffle(combos)
        chosen = []
        for combo in combos:
            parts = tuple(b for c in combo for b in c.parts)
            bug = combine(list(parts), texts[parts[0].path])
            if bug is not None:
                chosen.append(Candidate(_candidate_id(parts), parts, combo[0].split))
            if len(chosen) == per_group:
                break
        order.append(chosen)
    rng.shuffle(order)
    return list(_round_robin(order))


def _bug_of(c: Candidate, texts: dict[str, str]) -> Bug:
    bug = c.parts[0] if len(c.parts) == 1 else combine(list(c.parts), texts[c.parts[0].path])
    assert bug is not None, "a combined candidate is made only of bugs that combine"
    return bug


def _distance(c: Candidate, base: Baseline, tests: list[str]) -> int:
    depths = [base.runs[(b.path, b.code[1])].get(t) for b in c.parts for t in tests]
    return min((d for d in depths if d is not None), default=0)


def _try(how: Settings, base: Baseline, texts: dict[str, str], name: str, c: Candidate) -> dict:
    """One candidate's result (step 3 of the module docstring): {"id", "outcome" (KEPT or a DROPS
    reason), "detail", and for a kept one its task-file "record"}."""
    result = {"id": c.id, "outcome": "", "detail": ""}
    bug = _bug_of(c, texts)
    text = texts[bug.path]
    buggy = bug.apply(text)
    runs = {t: d for b in c.parts for t, d in base.runs[(b.path, b.code[1])].items()}
    selected = sorted(runs)
    task = replace(
        _base_task(how, f"{name}-{c.family.replace('_', '-')}-{c.id[:8]}"),
        split=c.split,
        start_patch=file_diff(bug.path, text, buggy),
        gold_patch=file_diff(bug.path, buggy, text),
    )
    # an endless loop is found in the time the tests took (traced) and a margin, not in --timeout
    quick = min(how.timeout_s, QUICK_S + 3 * sum(base.passing[t] for t in selected))
    run = run_tests(replace(task, metadata={**task.metadata, "timeout_s": quick}), {}, {}, selected, task_limits(task))
    if run.timed_out:
        return {**result, "outcome": "timeout", "detail": f"after {quick:.0f} s"}
    try:
        cases = junit_cases(run.report) if run.report else None
    except ParseError:
        cases = None
    if cases is None:
        return {**result, "outcome": "crash", "detail": f"no report (exit {run.exit_code})"}
    failing = [t for t in selected if cases.get(t) is None or cases[t].outcome != "passed"]
    if not failing:
        return {**result, "outcome": "no failing test", "detail": f"{len(selected)} tests run it, all pass"}
    passing = [t for t in selected if t not in failing]
    lines = function_lines(text)
    task = replace(
        task,
        instruction=statement({t: cases.get(t, _NOT_REPORTED) for t in failing}, how.detail),
        fail_to_pass=failing,
        pass_to_pass=passing,
        metadata={
            **task.metadata,
            "source": "synthesized",
            "rev": how.commit,
            "family": c.family,
            **({"families": [b.family for b in c.parts]} if len(c.parts) > 1 else {}),
            "function": bug.function,
            "path": bug.path,
            "line": bug.line,
            "sites": len(c.parts),
            "function_lines": lines.get(bug.function, 0),
            "distance": _distance(c, base, failing),
            "difficulty": len(c.parts),
        },
    )
    return validated(result, task)


def _journal_key(how: Settings, options: list) -> str:
    """What reused results depend on: the settings, the image's content (its cache root is named by
    its digest) and the options that choose and shape the candidates."""
    what = [how.source, how.commit, image_root(how.image), how.recipe.to_record(), how.test_command]
    return content_key(json.dumps([*what, how.timeout_s, how.memory_mb, how.detail, options, 1]))


def _validate_all(
    how: Settings,
    base: Baseline,
    texts: dict[str, str],
    name: str,
    candidates: list[Candidate],
    target: int | None,
    results: dict[str, dict],
    log,
    jobs: int,
    bar,
) -> tuple[list[Candidate], int]:
    """Validate `candidates` in order, `jobs` at once, until `target` are kept (all without one);
    results already known are reused, new ones appended to the journal `log`. Returns the kept
    candidates, in order (the first `target`), and how many candidates were looked at."""
    kept: list[Candidate] = []
    looked = 0
    pool = ThreadPoolExecutor(max(1, jobs))
    try:
        while looked < len(candidates) and (target is None or len(kept) < target):
            # a chunk at a time, read in order: which candidates are kept does not depend on `jobs`
            chunk = candidates[looked : looked + 4 * max(1, jobs)]
            todo = {c.id: pool.submit(_try, how, base, texts, name, c) for c in chunk if c.id not in results}
            for c in chunk:
                if c.id in todo:
                    results[c.id] = todo[c.id].result()
                    log(results[c.id])
                if target is not None and len(kept) == target:
                    continue  # validated with its chunk, journaled, but past the target
                looked += 1
                kept += [c] if results[c.id]["outcome"] == KEPT else []
                bar.update(1)
                bar.set_postfix(kept=len(kept))
    finally:  # on an error or Ctrl-C, candidates not started are not started
        pool.shutdown(wait=True, cancel_futures=True)
    return kept, looked


def synth(
    source: str,
    out: Path,
    image: str = "",
    rev: str = "HEAD",
    jobs: int = 1,
    max_tasks: int | None = None,
    combined: int | None = None,
    combine_in: SplitBy = "function",
    families: tuple[str, ...] = bug_families.FAMILIES,
    per_function: int = 10,
    eval_fraction: float = 0.2,
    eval_only: list[str] | None = None,
    split_by: SplitBy = "function",
    detail: Detail = "errors",
    timeout_s: float = TIMEOUT_S,
    memory_mb: int = MEMORY_MB,
    recipe: Recipe | None = None,
    test_command: list[str] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Synthesize tasks from `source` (a git working copy, bare repository or bundle) at `rev` into the
    task file `out` and `<out>.report.json` (see the module docstring); returns the report.
    `max_tasks` stops after that many single bugs are kept; `combined` is how many combined bugs to
    keep (default: a fifth of the single ones)."""
    from tqdm import tqdm

    unknown = sorted(set(families) - set(bug_families.FAMILIES))
    if unknown:
        raise UserError(f"unknown bug family {unknown[0]!r}; the families: {', '.join(bug_families.FAMILIES)}")
    out = Path(out)
    check_outputs(out, "strop tasks synth", JOURNAL_FIRST, REPORT_KEYS)  # refused before any work, as are
    image_root(image)  # a missing or broken image
    check_runner(image, Limits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=2 * math.ceil(timeout_s)))
    _, sha = history(source, rev)
    source = source if is_url(source) else str(Path(source).resolve())
    tree = checkout(source, sha)
    how = Settings(
        source,
        sha,
        str(Path(image).resolve()) if image else "",
        replace(recipe if recipe is not None else detect(tree), notes=()),
        tuple(test_command or TEST_COMMAND),
        timeout_s,
        memory_mb,
        detail,
    )
    name = repo_name(source)
    options = [sorted(families), per_function, seed, eval_fraction, eval_only, split_by, combine_in]
    key = _journal_key(how, options)
    journal = out.with_name(out.name + ".partial")
    entries = journal_entries(journal, key)
    known = next((e["baseline"] for e in entries if "baseline" in e), None)
    results = {e["result"]["id"]: e["result"] for e in entries if "result" in e}
    journaled = set(results)  # what an earlier sitting validated: reused, not run again
    if not known and progress and sys.stderr.isatty():  # a note for people; an error stays one line in a log
        print(f"synth: {name} at {sha[:12]}: running its tests once, traced", file=sys.stderr, flush=True)
    base = Baseline.from_dict(known) if known else run_baseline(how, tree)
    texts = {p: (tree / p).read_text(errors="replace") for p in base.sources}
    rule = lambda bug: split_of(bug, split_by, eval_fraction, eval_only)  # noqa: E731
    singles, found = single_candidates(texts, base, tuple(families), per_function, seed, rule)
    if not singles:
        what = "no function" if not found["sites"] else "no bug site in code the passing tests run"
        raise UserError(f"{what} to inject bugs into in {len(base.sources)} source files of {source} at {sha[:12]}")
    with open_journal(journal) as log_file:
        if not known:
            log_file.write(json.dumps({"key": key, "baseline": base.to_dict()}) + "\n")

        def log(result: dict) -> None:
            log_file.write(json.dumps({"key": key, "result": result}) + "\n")
            log_file.flush()

        with tqdm(
            total=len(singles), desc="synth: single bugs", unit="bug", dynamic_ncols=True, disable=not progress
        ) as bar:
            kept, n_singles = _validate_all(how, base, texts, name, singles, max_tasks, results, log, jobs, bar)
        pairs = combined_candidates(kept, texts, combine_in, 2, seed)
        want = len(kept) // 5 if combined is None else combined
        with tqdm(
            total=len(pairs),
            desc="synth: combined bugs",
            unit="bug",
            dynamic_ncols=True,
            disable=not progress or not want,
        ) as bar:
            both, n_pairs = (
                _validate_all(how, base, texts, name, pairs, want, results, log, jobs, bar) if want else ([], 0)
            )
    kept += both
    tried = singles[:n_singles] + pairs[:n_pairs]
    lines = []
    for c in kept:
        task, _ = task_from_record(results[c.id]["record"], c.id, Path("/"), "")
        lines.append(json.dumps(task_record(task, out.resolve().parent), sort_keys=True) + "\n")
    kept_tasks = [results[c.id]["record"] for c in kept]
    report = {
        "repo": source if is_url(source) else os.path.relpath(source, out.resolve().parent),
        "rev": sha,
        "image": how.image,
        "recipe": how.recipe.to_record(),
        "tests": {"collected": base.collected, "passing": len(base.passing)},
        "source_files": len(base.sources),
        **found,
        "candidates": len(singles) + len(pairs),
        "tried": len(tried),
        "reused": sum(c.id in journaled for c in tried),  # from the journal of an earlier sitting
        "run": len(results) - len(journaled),  # validated in this sitting (with a chunk past the target)
        "kept": len(kept),
        "train": sum(r["split"] == "train" for r in kept_tasks),
        "eval": sum(r["split"] == "eval" for r in kept_tasks),
        "dropped": {reason: sum(results[c.id]["outcome"] == reason for c in tried) for reason in DROPS},
        "families": _count(r["metadata"]["family"] for r in kept_tasks),
        "kept_functions": len({(r["metadata"]["path"], r["metadata"]["function"]) for r in kept_tasks}),
        "difficulties": _count(str(r["difficulty"]) for r in kept_tasks),
        "tried_by_family": {
            f: {o: sum(results[c.id]["outcome"] == o for c in tried if c.family == f) for o in (KEPT, *DROPS)}
            for f in sorted({c.family for c in tried})
        },
        "candidates_tried": [
            {"id": c.id, "family": c.family, "function": f"{c.parts[0].path}::{c.parts[0].function}"}
            | {k: results[c.id][k] for k in ("outcome", "detail")}
            for c in tried
        ],
    }
    return write_outputs(out, lines, report, journal)


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return dict(sorted(counts.items()))
