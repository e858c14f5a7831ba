"""`strop serve key`: add an API key to a key file (made if missing) and print the key, once.

The file keeps only the key's SHA-256 (see `strop.online.auth`); a lost key is replaced, not recovered.
"""

import argparse
from pathlib import Path

from strop.errors import UserError
from strop.online.auth import SCOPES, KeyFile
from strop.outputs import check_output_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", required=True, help="key file to add to (JSON; created if missing)")
    parser.add_argument("--name", required=True, help="who or what holds the key (logged with its requests)")
    parser.add_argument("--scopes", required=True, help=f"comma-separated, some of: {', '.join(SCOPES)}")
    parser.add_argument("--rate", type=float, default=50.0, help="sustained requests a second")
    parser.add_argument("--burst", type=int, default=100, help="requests allowed at once above the rate")


def run(args: argparse.Namespace) -> int:
    check_output_file(args.keys)  # before the key is made: it is shown once, and only if it is saved
    try:
        keys = KeyFile.load(args.keys) if Path(args.keys).exists() else KeyFile()
        key = keys.add(args.name, [s.strip() for s in args.scopes.split(",") if s.strip()], args.rate, args.burst)
    except ValueError as e:
        raise UserError(str(e)) from None
    keys.save(args.keys)
    print(key)
    return 0
