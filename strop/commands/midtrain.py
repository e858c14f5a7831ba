"""`strop midtrain --config F`: continued pretraining of a policy on code tokens
(`strop.train.midtrain`); prints the final figures as JSON."""

import argparse
import json

from strop.config import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from strop.train.midtrain import midtrain

    cfg = config_from_args(args)
    result = midtrain(cfg)
    print(json.dumps(result, indent=2))
    return 0
