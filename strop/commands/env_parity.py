"""`strop env parity`: what an agent could probe inside a sandbox and on the host, side by side
(`strop.env.sandbox.parity`), as a table; `--json` writes the full probe values."""

import argparse
import json
import shutil
from pathlib import Path

from strop.errors import UserError
from strop.outputs import write_atomic


def _short(v: str, width: int) -> str:
    v = v.replace("\n", " | ")
    return v if len(v) <= width else v[: width - 1] + "…"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", type=Path, help="the directory at /home/dev/repo (default: an empty one)")
    p.add_argument("--image", default="", help="OS image of the sandbox (default: the host's root)")
    p.add_argument("--width", type=int, default=48, help="column width for values")
    p.add_argument("--json", help="also write the full probe values to this JSON file")


def run(args: argparse.Namespace) -> int:
    import os

    from strop.env.host.scratch import scratch_dir
    from strop.env.sandbox.parity import compare, probe_host, probe_sandbox
    from strop.threads import set_threads

    host_env = dict(os.environ)  # before set_threads adds OMP_NUM_THREADS & co, which `nproc` obeys
    set_threads(1)
    if args.repo is not None and not args.repo.is_dir():
        raise UserError(f"--repo {args.repo} is not a directory")
    from strop.env.world.image import image_root

    image = image_root(args.image)
    empty = scratch_dir("world")  # swept by a later strop process if this one is killed
    try:
        repo_dir = args.repo or empty
        rows = compare(probe_sandbox(repo_dir, image), probe_host(repo_dir, host_env))
    finally:
        shutil.rmtree(empty, ignore_errors=True)
    w = args.width
    name_w = max(len(r["probe"]) for r in rows)
    print(f"{'probe':<{name_w}}  {'sandbox':<{w}}  {'host':<{w}}  same")
    print(f"{'-' * name_w}  {'-' * w}  {'-' * w}  ----")
    for r in rows:
        print(
            f"{r['probe']:<{name_w}}  {_short(r['sandbox'], w):<{w}}  {_short(r['host'], w):<{w}}  "
            f"{'yes' if r['same'] else 'NO'}"
        )
    diffs = [r["probe"] for r in rows if not r["same"]]
    print(f"\n{len(diffs)} of {len(rows)} probes differ: {', '.join(diffs) or 'none'}")
    if args.json:
        write_atomic(args.json, json.dumps(rows, indent=2))
    return 0
