"""`strop sft --config F [--base DIR]`: the SFT warm start on the oracle's demonstrations
(`strop.train.sft`); prints the figures as JSON."""

import argparse
import json

from strop.config import add_config_arguments, config_from_args
from strop.outputs import claim_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--base", help="model directory to start from (default: <run_dir>/midtrain/model)")


def run(args: argparse.Namespace) -> int:
    from strop.env.harness.loop import harness_config
    from strop.train.sft import sft

    cfg = config_from_args(args)
    harness_config(cfg.rollout, cfg.harness)  # a bad [harness] is refused before any model loads
    claim_dir(cfg.run_dir / "sft", "sft")  # it overwrites model/ and its caches in there
    print(json.dumps(sft(cfg, args.base), indent=2))
    return 0
