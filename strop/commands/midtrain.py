"""`strop midtrain --config F`: continued pretraining of a policy on code tokens
(`strop.train.midtrain`); prints the final figures as JSON."""

import argparse
import json

from strop.config import add_config_arguments, config_from_args
from strop.outputs import claim_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from strop.train.midtrain import midtrain

    cfg = config_from_args(args)
    claim_dir(cfg.run_dir / "midtrain", "midtrain")  # it overwrites model/ and its caches in there
    result = midtrain(cfg)
    print(json.dumps(result, indent=2))
    return 0
