"""`strop sync decode`: apply a delta to its base weights, verifying every tensor, bit-exactly."""

import argparse
import os

from strop.errors import UserError
from strop.outputs import check_output_file, write_atomic


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, help="the weights the delta was made against (safetensors)")
    p.add_argument("delta", help="the delta file from `strop sync encode`")
    p.add_argument("-o", "--output", required=True, help="where to write the new weights (safetensors)")


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads()
    from strop.sync import codec, tensors

    check_output_file(args.output)
    for path in (args.base, args.delta):
        if not os.path.isfile(path):
            raise UserError(f"no such file: {path}")
    try:
        base = tensors.load(args.base)
    except ValueError as e:
        raise UserError(f"{args.base}: {e}") from None
    with open(args.delta, "rb") as f:
        blob = f.read()
    try:
        new = codec.decode(base, blob)
    except codec.DeltaError as e:
        raise UserError(f"{args.delta}: {e}") from None
    write_atomic(args.output, tensors.to_bytes(new))  # a kill mid-write leaves the previous file whole
    print(f"{args.output}: {len(new)} tensors, each verified against the trainer's checksum")
    return 0
