"""`strop eval midtrain --checkpoint DIR`: held-out bits per byte of a mid-trained model next to
`gzip -9` and `zstd -19` (`strop.train.eval_midtrain`)."""

import argparse
import json

from strop.errors import UserError
from strop.outputs import write_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True, help="model directory (HF format, e.g. runs/demo/midtrain/model)"
    )
    parser.add_argument("--json", help="write the figures to this JSON file")
    parser.add_argument("--window", type=int, default=0, help="context window in tokens; 0 = the training seq_len")
    parser.add_argument(
        "--config",
        "-c",
        help="TOML run config whose [data] section picks the held-out files "
        "(default: the config saved with the checkpoint)",
    )


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads
    from strop.train.eval_midtrain import evaluate

    set_threads()
    if args.window < 0:
        raise UserError("--window must be positive")
    result = evaluate(args.checkpoint, args.config, args.window)
    print(f"held-out {result['val_files']} files, {result['val_bytes']:,} bytes (window {result['window']} tokens)")
    for key, name in (
        ("val_bits_per_byte", "strop model"),
        ("gzip_bits_per_byte", "gzip -9"),
        ("zstd_bits_per_byte", "zstd -19"),
    ):
        print(f"  {name:<12} {result[key]:.3f} bits/byte")
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=2))
    return 0
