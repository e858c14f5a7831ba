"""`strop sync encode`: write the lossless delta taking one safetensors file to another."""

import argparse
import os
import time

from strop.errors import UserError
from strop.outputs import check_output_file, write_atomic


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, help="the previous weights (safetensors)")
    p.add_argument("--new", required=True, help="the new weights (safetensors)")
    p.add_argument("-o", "--output", required=True, help="where to write the delta")
    p.add_argument("--version", type=int, default=1, help="version number of --new (recorded in the delta)")
    p.add_argument("--base-version", type=int, default=None, help="version of --base (default: --version - 1)")


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads()
    from strop.sync import codec, tensors

    check_output_file(args.output)  # before the work: a bad -o is a user mistake, not a traceback after it
    base_version = args.version - 1 if args.base_version is None else args.base_version
    if not 0 <= base_version < args.version:
        raise UserError(f"versions must satisfy 0 <= --base-version < --version, got {base_version} and {args.version}")
    states = []
    for path in (args.base, args.new):
        if not os.path.isfile(path):
            raise UserError(f"no such file: {path}")
        try:
            states.append(tensors.load(path))
        except ValueError as e:
            raise UserError(f"{path}: {e}") from None
    t = time.perf_counter()
    blob = codec.encode(states[0], states[1], version=args.version, base_version=base_version)
    dt = time.perf_counter() - t
    write_atomic(args.output, blob)  # a kill mid-write leaves the previous file, never a truncated one
    raw = sum(x.nbytes for x in states[1].values())
    h = codec.read_header(blob)
    methods = {m: sum(e.method == m for e in h.entries) for m in codec.METHODS}
    print(
        f"{args.output}: {len(blob):,} bytes for {raw:,} bytes of weights ({raw / max(len(blob), 1):.1f}x), "
        f"tensors {methods}, {raw / dt / 1e6:.0f} MB/s"
    )
    return 0
