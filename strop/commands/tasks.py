"""`strop tasks list|export|check|build`: look at task suites, write a task's starting repository,
and score a directory as an agent's final workspace (reward, breakdown, hack flags), so anyone can
audit the checker with a hand-made solution or a hack."""

import argparse
import json
import os
import sys
from pathlib import Path

from strop.beneath import parts_of
from strop.errors import UserError
from strop.outputs import write_atomic


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
    p = sub.add_parser("build", help="build and cache a suite that needs it (mutated)")
    p.add_argument("--suite", required=True, help="task suite, e.g. synthetic/parse, humaneval, chain")
    p.add_argument("--target", type=int, default=240, help="tasks to keep")


def run(args: argparse.Namespace) -> int:
    from strop.env.suites import get_task, load_suite
    from strop.threads import set_threads

    set_threads(1)
    if args.action == "list":
        for t in load_suite(args.suite, args.split):
            print(f"{t.id}\t{t.split}\t{t.metadata.get('family', '')}\t{t.metadata.get('difficulty', '')}")
        return 0
    if args.action == "build":
        if args.suite != "mutated":
            raise UserError(f"suite {args.suite!r} needs no build (only mutated does)")
        from strop.env.suites.mutated import build

        build(target=args.target, log=lambda m: print(m, file=sys.stderr))
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
        from strop.env.world import materialize

        try:
            root.mkdir(parents=True, exist_ok=True)
            # beside DIR: made new, never through a link (O_EXCL), so nothing of the user's is overwritten
            fd = os.open(note, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UserError(f"cannot create {e.filename}: {e.strerror}") from None
        with os.fdopen(fd, "w") as f:
            f.write(task.instruction + "\n")
        materialize(task, root)
        print(task.instruction)
        print(f"wrote {len(task.files)} files to {root} (instruction also in {root.name}.instruction.txt beside it)")
        return 0
    if not root.is_dir():
        raise UserError(f"{root} is not a directory")
    from strop.env.checker import check
    from strop.env.hacks import detect
    from strop.env.world import workspace_changes

    changes, skipped = workspace_changes(task, root)
    if skipped:  # a symlink in DIR may point anywhere on this host: its target is not the agent's code
        print(f"left out (not regular files): {', '.join(skipped)}")
    score = check(task, changes, mode=args.mode)
    flags = detect(task, changes, [], score)
    result = {"task": task.id, "changed": sorted(changes), **score.to_dict(), "flags": [f.to_dict() for f in flags]}
    print(
        f"{task.id}: reward {score.reward:g} ({score.reason}); passed {score.passed}, failed {score.failed}, "
        f"errors {score.errors}, skipped {score.skipped}; {score.duration:.1f} s"
    )
    if score.detail:
        print(f"first check that did not pass: {score.detail}")
    if score.dropped_paths:
        print(f"dropped (protected): {', '.join(score.dropped_paths)}")
    if score.perturbed_reward is not None:
        print(f"perturbed tests: reward {score.perturbed_reward:g} ({score.perturbed_reason})")
    for f in flags:
        print(f"hack flag {f.kind}: {f.evidence}")
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=2))
    return 0
