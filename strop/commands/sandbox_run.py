"""`strop sandbox run`: run one command in a fresh sandbox, stream its output, exit with its code.

For people and for audits: exactly the sandbox a rollout gets (same user, limits), on the OS image
of your choice (`--image`; the host's root by default) and a world directory of your choice (an
empty one by default; the directory itself is never modified: changes live in the sandbox's
copy-on-write layer and vanish with it). Exits 124 on timeout, like coreutils `timeout`, and 125
when the workspace outgrew its limit.
"""

import argparse
import math
import shutil
import sys
from pathlib import Path

from strop.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", type=Path, help="directory that appears at /home/dev/repo (default: an empty one)")
    p.add_argument(
        "--image",
        default="",
        help="OS image: a root directory, an OCI image layout (directory or tar) or a `docker save` archive "
        "(default: the host's root)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="wall-clock limit in seconds (default 30)")
    p.add_argument("--memory", type=int, default=1024, help="address-space limit per process in MB (default 1024)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]: the command and its arguments")


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(1)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UserError("no command given: strop sandbox run [options] -- CMD [ARGS...]")
    if args.repo is not None and not args.repo.is_dir():
        raise UserError(f"--repo {args.repo} is not a directory")
    from strop.env.host.scratch import scratch_dir
    from strop.env.sandbox.backend import open_sandbox
    from strop.env.sandbox.interface import Limits
    from strop.env.world.image import image_root

    image = image_root(args.image)  # unpacked into the node cache on first use

    if not (math.isfinite(args.timeout) and args.timeout > 0):  # `nan <= 0` is false: NaN meant no limit
        raise UserError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.memory < 1:
        raise UserError(f"--memory must be at least 1 MB, got {args.memory}")
    limits = Limits(memory_mb=args.memory, timeout_s=args.timeout)
    streams = {1: sys.stdout.buffer, 2: sys.stderr.buffer}

    def show(stream: int, data: bytes) -> None:
        streams[stream].write(data)
        streams[stream].flush()

    empty = scratch_dir("world")  # swept by a later strop process if this one is killed
    try:
        sb = open_sandbox(args.repo or empty, limits, image)
        try:
            res = sb.exec(cmd, on_output=show)
        finally:
            sb.close()
    finally:
        shutil.rmtree(empty, ignore_errors=True)
    if res.stdout_truncated or res.stderr_truncated:
        print(f"\nstrop: output truncated at {limits.output_bytes} bytes per stream", file=sys.stderr)
    if res.timed_out:
        print(f"strop: timed out after {args.timeout:g} s; the sandbox was killed", file=sys.stderr)
    if res.workspace_exceeded:
        print(f"strop: the workspace outgrew {limits.workspace_mb} MB; the command was killed", file=sys.stderr)
    return 125 if res.workspace_exceeded else res.exit_code
