"""`strop tasks list|export|check|build|mine|synth|validate`: look at task suites, write a task's starting
repository, and score a directory as an agent's final workspace (reward, breakdown, hack flags), so
anyone can audit the checker with a hand-made solution or a hack; mine a task file from a
repository's history (`strop.env.tasks.mine`), synthesize one from its code (`strop.env.tasks.synth`)
and validate any task file."""

import argparse
import json
import os
import sys
from pathlib import Path

from strop.confined import parts_of, write_new
from strop.errors import UserError
from strop.outputs import write_atomic
from strop.terminal import show


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, help="what to do with the suite")
    p = sub.add_parser("list", help="task ids, split, family and difficulty")
    p.add_argument("--suite", required=True, help="task suite, e.g. synthetic/parse, humaneval, chain")
    p.add_argument("--split", choices=["train", "eval"], help="only this split (default: both)")
    p = sub.add_parser("export", help="write exactly what the agent sees at the start")
    p.add_argument("--suite", required=True, help="task suite, e.g. synthetic/parse, humaneval, chain")
    p.add_argument("id", help="task id (`strop tasks list`)")
    p.add_argument("dir", help="directory to write the task's starting files into")
    p = sub.add_parser("check", help="score DIR as the agent's final workspace")
    p.add_argument("--suite", required=True, help="task suite, e.g. synthetic/parse, humaneval, chain")
    p.add_argument("id", help="task id (`strop tasks list`)")
    p.add_argument("dir", help="the workspace to score, as the agent left it")
    p.add_argument("--json", help="also write the result to this JSON file")
    p.add_argument(
        "--mode",
        choices=["binary", "fraction"],
        default="binary",
        help="reward: 1 only if every check passes, or the passed share",
    )
    p = sub.add_parser("build", help="build and cache a suite that needs it (mutated/PACKAGE)")
    p.add_argument("--suite", required=True, help="mutated/PACKAGE: an installed package whose tests ship in it")
    p.add_argument("--target", type=int, default=240, help="single-bug tasks to keep (default 240)")
    p.add_argument("--jobs", type=int, default=2, help="candidates validated at once (default 2)")
    p = sub.add_parser("mine", help="a task file from a repository's history: commits that fix code and test it")
    p.add_argument("--repo", required=True, help="a git repository: a working copy, bare repository or bundle")
    p.add_argument("--image", default="", help="OS image to run the tests in (default: the host's root)")
    p.add_argument("--out", required=True, help="task file to write (JSONL); its yield report goes beside it")
    p.add_argument("--rev", default="HEAD", help="whose history to walk (default HEAD)")
    p.add_argument("--max-commits", type=int, help="walk only the newest N non-merge commits")
    p.add_argument("--jobs", type=int, default=1, help="commits mined at once (default 1)")
    p.add_argument("--eval-fraction", type=float, default=0.2, help="the newest share of kept tasks held out (0.2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one test run may take (default 300)")
    p.add_argument("--memory-mb", type=int, default=4096, help="address space of a test run (default 4096)")
    _recipe_arguments(p)
    p.add_argument(
        "--tests",
        choices=["modules", "touched"],
        default="modules",
        help="run every test of the changed test modules, or only the tests the commit touches (much cheaper)",
    )
    p = sub.add_parser("synth", help="a task file of bugs injected into a repository's functions that its tests catch")
    p.add_argument("--repo", required=True, help="a git repository: a working copy, bare repository or bundle")
    p.add_argument("--rev", default="HEAD", help="the commit whose code gets the bugs (default HEAD)")
    p.add_argument("--image", default="", help="OS image to run the tests in (default: the host's root)")
    p.add_argument("--out", required=True, help="task file to write (JSONL); its yield report goes beside it")
    p.add_argument("--jobs", type=int, default=1, help="candidates validated at once (default 1)")
    p.add_argument("--max-tasks", type=int, help="stop once this many single bugs are kept (default: try all)")
    p.add_argument("--combined", type=int, help="combined bugs (2-3 in one function) to keep (default: a fifth)")
    p.add_argument("--combine-in", choices=["function", "module"], default="function", help="where combined bugs sit")
    p.add_argument("--families", help="comma-separated bug families (default: all; `strop tasks synth --help`)")
    p.add_argument("--per-function", type=int, default=10, help="candidates tried per function at most (10)")
    p.add_argument("--eval-fraction", type=float, default=0.2, help="share of functions held out (0.2)")
    p.add_argument("--eval-only", help="comma-separated functions or modules held out (the rest train)")
    p.add_argument("--split-by", choices=["function", "module"], default="function", help="the held-out unit")
    p.add_argument(
        "--statement",
        choices=["names", "errors", "full"],
        default="errors",
        help="what the problem statement shows of the failing tests: names, one-line errors, full output",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one test run may take (default 120)")
    p.add_argument("--memory-mb", type=int, default=4096, help="address space of a test run (default 4096)")
    p.add_argument("--seed", type=int, default=0, help="the order candidates are tried in (default 0)")
    _recipe_arguments(p)
    p = sub.add_parser("validate", help="check every task of a task file: gold passes, the start fails FAIL_TO_PASS")
    p.add_argument("file", help="the task file (JSONL)")
    p.add_argument("--image", default="", help="OS image of the tasks that name none (default: the host's root)")
    p.add_argument("--jobs", type=int, default=1, help="tasks validated at once (default 1)")
    p.add_argument("--json", help="also write the verdicts to this JSON file")


def _recipe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recipe", help="TOML file: paths, setup, test_command (default: detected from the repository's files)"
    )
    p.add_argument("--path", action="append", default=[], help="a directory put on the import path (repeatable)")
    p.add_argument("--setup", action="append", default=[], help="a shell command run before the tests (repeatable)")


def _recipe(args: argparse.Namespace):
    """(the recipe the user gave, None = detect; the test command, None = the default)."""
    from strop.env.recipe import Recipe, check_path, read_recipe_file

    recipe, test_command = read_recipe_file(args.recipe) if args.recipe else (None, None)
    if args.path or args.setup:
        recipe = recipe or Recipe()
        paths = tuple(check_path("--path", p) for p in args.path)
        recipe = Recipe(paths=recipe.paths + paths, setup=recipe.setup + tuple(args.setup), notes=("from the flags",))
    return recipe, test_command


def run(args: argparse.Namespace) -> int:
    from strop.env.tasks.suites import get_task, load_suite
    from strop.threads import set_threads

    set_threads(1)
    if args.action == "mine":
        return _mine(args)
    if args.action == "synth":
        return _synth(args)
    if args.action == "validate":
        return _validate(args)
    if args.action == "list":
        for t in load_suite(args.suite, args.split):
            show(f"{t.id}\t{t.split}\t{t.metadata.get('family', '')}\t{t.metadata.get('difficulty', '')}")
        return 0
    if args.action == "build":
        base, _, package = args.suite.partition("/")
        if base != "mutated" or not package:
            raise UserError(f"suite {args.suite!r} needs no build (only mutated/PACKAGE does)")
        from strop.env.suites.mutated import build

        _at_least_one("--target", args.target)
        _at_least_one("--jobs", args.jobs)
        print(f"wrote {build(package, target=args.target, jobs=args.jobs)}")
        return 0
    task = get_task(args.suite, args.id)
    root = Path(args.dir)
    if args.action == "export":
        note = root.parent / f"{root.name}.instruction.txt"
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise UserError(
                f"{root} is {'not empty' if root.is_dir() else 'not a directory'}; export writes a new or empty one"
            )
        if os.path.lexists(note):
            raise UserError(f"{note} exists; export does not overwrite it")
        for rel in task.files:
            parts_of(rel)  # every path inside DIR (new or empty: no link to follow), before anything is written
        from strop.env.world.task_world import materialize

        try:
            root.mkdir(parents=True, exist_ok=True)
            write_new(note, (task.instruction + "\n").encode())  # beside DIR: nothing of the user's overwritten
        except OSError as e:
            raise UserError(f"cannot create {e.filename}: {e.strerror}") from None
        materialize(task, root)
        written = sum(len(files) for d, _, files in os.walk(root) if ".git" not in Path(d).relative_to(root).parts)
        show(task.instruction)
        print(f"wrote {written} files to {root} (instruction also in {root.name}.instruction.txt beside it)")
        return 0
    if not root.is_dir():
        raise UserError(f"{root} is not a directory")
    from strop.env.grading.checker import check
    from strop.env.grading.hack_monitor import detect
    from strop.env.world.task_world import workspace_changes

    changes, skipped = workspace_changes(task, root)
    if skipped:  # a symlink in DIR may point anywhere on this host: its target is not the agent's code
        show(f"left out (not regular files): {', '.join(skipped)}")
    score = check(task, changes, mode=args.mode)
    flags = detect(task, changes, [], score)
    result = {"task": task.id, "changed": sorted(changes), **score.to_dict(), "flags": [f.to_dict() for f in flags]}
    show(
        f"{task.id}: reward {score.reward:g} ({score.reason}); passed {score.passed}, failed {score.failed}, "
        f"errors {score.errors}, skipped {score.skipped}; {score.duration:.1f} s"
    )
    if score.detail:
        show(f"first check that did not pass: {score.detail}")
    if score.dropped_paths:
        show(f"dropped (protected): {', '.join(score.dropped_paths)}")
    if score.perturbed_reward is not None:
        show(f"perturbed tests: reward {score.perturbed_reward:g} ({score.perturbed_reason})")
    for f in flags:
        show(f"hack flag {f.kind}: {f.evidence}")
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=2))
    return 0


def _at_least_one(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UserError(f"{name} must be at least 1, got {value}")


def _check_limits(args: argparse.Namespace) -> None:
    """The options `mine` and `synth` share: --jobs, --memory-mb, --eval-fraction, --timeout."""
    _at_least_one("--jobs", args.jobs)
    _at_least_one("--memory-mb", args.memory_mb)
    if not 0.0 <= args.eval_fraction <= 1.0:
        raise UserError(f"--eval-fraction must be between 0 and 1, got {args.eval_fraction}")
    if not args.timeout > 0:
        raise UserError(f"--timeout must be a positive number of seconds, got {args.timeout}")


def _mine(args: argparse.Namespace) -> int:
    from strop.bench.table import format_table
    from strop.env.tasks.mine import DROPS, mine, report_path
    from strop.outputs import check_output_file

    _at_least_one("--max-commits", args.max_commits)
    _check_limits(args)
    out = check_output_file(args.out)
    recipe, test_command = _recipe(args)
    report = mine(
        args.repo,
        out,
        image=args.image,
        rev=args.rev,
        max_commits=args.max_commits,
        jobs=args.jobs,
        eval_fraction=args.eval_fraction,
        timeout_s=args.timeout,
        memory_mb=args.memory_mb,
        tests=args.tests,
        recipe=recipe,
        test_command=test_command,
    )
    rows = [{"outcome": "kept", "commits": report["kept"]}]
    rows += [{"outcome": f"dropped: {reason}", "commits": report["dropped"][reason]} for reason in DROPS]
    print(
        f"{report['candidates']} candidates (commits changing code and tests) among {report['commits_walked']} "
        f"commits of {args.repo} at {report['rev'][:12]}"
    )
    print(format_table(rows, ["outcome", "commits"]))
    for recipe_field, n in report["recipes"].items():
        print(f"recipe {recipe_field}: {n} tasks")
    print(f"wrote {report['kept']} tasks ({report['train']} train, {report['eval']} eval) to {out}")
    print(f"yield report: {report_path(out)}")
    if report["kept"] == 0:  # an empty task file is no result: say why, and fail
        show(f"strop: no tasks: {_no_tasks_why(report)}", file=sys.stderr)
        return 1
    return 0


def _no_tasks_why(report: dict) -> str:
    """Why mining kept nothing, in one line: no candidates, or the commonest drop and its first detail."""
    if not report["candidates"]:
        return f"none of the {report['commits_walked']} commits walked changes both source code and a test file"
    reason, n = max(report["dropped"].items(), key=lambda kv: kv[1])
    detail = next(c["detail"] for c in report["commits"] if c["outcome"] == reason)
    return f"{n} of {report['candidates']} candidates dropped as {reason!r}, e.g. {detail}"


def _synth(args: argparse.Namespace) -> int:
    import time

    from strop.bench.table import format_table
    from strop.env.tasks.bugs import FAMILIES
    from strop.env.tasks.mine import report_path
    from strop.env.tasks.synth import DROPS, synth
    from strop.outputs import check_output_file

    _at_least_one("--max-tasks", args.max_tasks)
    _at_least_one("--per-function", args.per_function)
    _check_limits(args)
    if args.combined is not None and args.combined < 0:
        raise UserError(f"--combined must be 0 or more, got {args.combined}")
    families = tuple(f.strip() for f in args.families.split(",") if f.strip()) if args.families else FAMILIES
    eval_only = [n.strip() for n in args.eval_only.split(",") if n.strip()] if args.eval_only else None
    out = check_output_file(args.out)
    recipe, test_command = _recipe(args)
    start = time.perf_counter()
    report = synth(
        args.repo,
        out,
        image=args.image,
        rev=args.rev,
        jobs=args.jobs,
        max_tasks=args.max_tasks,
        combined=args.combined,
        combine_in=args.combine_in,
        families=families,
        per_function=args.per_function,
        eval_fraction=args.eval_fraction,
        eval_only=eval_only,
        split_by=args.split_by,
        detail=args.statement,
        timeout_s=args.timeout,
        memory_mb=args.memory_mb,
        recipe=recipe,
        test_command=test_command,
        seed=args.seed,
    )
    seconds = time.perf_counter() - start
    tests = report["tests"]
    print(
        f"{args.repo} at {report['rev'][:12]}: {report['source_files']} source files, {report['sites']} bug sites "
        f"({report['sites_not_run']} in code no passing test runs) in {report['functions']} functions run by "
        f"{tests['passing']} of {tests['collected']} tests; recipe {json.dumps(report['recipe'])}"
    )
    rows = [{"outcome": "kept", "candidates": report["kept"]}]
    rows += [{"outcome": f"dropped: {reason}", "candidates": report["dropped"][reason]} for reason in DROPS]
    print(format_table(rows, ["outcome", "candidates"]))
    print(format_table([{"family": f, **n} for f, n in report["tried_by_family"].items()], ["family", "kept", *DROPS]))
    print(
        f"wrote {report['kept']} tasks ({report['train']} train, {report['eval']} eval) in {len(report['families'])} "
        f"families and {report['kept_functions']} functions to {out}; {report['tried']} candidates tried "
        f"({report['reused']} from the journal); {report['run']} validated in {seconds:.0f} s "
        f"({seconds / max(1, report['run']):.1f} s each)"
    )
    print(f"yield report: {report_path(out)}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from strop.bench.table import format_table
    from strop.env.tasks.mine import validate
    from strop.env.tasks.suites import with_default_image
    from strop.env.tasks.task_file import read_tasks
    from strop.env.world.image import image_root
    from strop.env.world.repo import resolve_commit
    from strop.outputs import check_output_file

    _at_least_one("--jobs", args.jobs)
    if args.json:
        check_output_file(args.json)
    tasks = with_default_image([t for t, _ in read_tasks(args.file)], args.image)
    for task in tasks:  # bad input is refused before anything runs: a missing image, repository or commit
        image_root(task.image)
        if task.repo and task.base_commit:
            resolve_commit(task.repo, task.base_commit)
    with ThreadPoolExecutor(args.jobs) as pool:
        verdicts = list(tqdm(pool.map(validate, tasks), total=len(tasks), desc="validating", unit="task"))
    rows = [{"task": v.task, "valid": "yes" if v.ok else "NO", "gold patch": v.gold, "start": v.base} for v in verdicts]
    show(format_table(rows, ["task", "valid", "gold patch", "start"]))
    bad = [v for v in verdicts if not v.ok]
    for v in bad:
        show(v.problem)
    print(f"{len(verdicts) - len(bad)} of {len(verdicts)} tasks valid")
    if args.json:
        write_atomic(args.json, json.dumps([v.__dict__ for v in verdicts], indent=2))
    return 1 if bad else 0
