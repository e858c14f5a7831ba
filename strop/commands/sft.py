"""`strop sft --config F [--policy DIR]`: the SFT warm start on the oracle's demonstrations
(`strop.train.sft`); prints the figures as JSON. `--policy` names the model to start from, as it
does for `strop train`; `--base`, its old name, still works, with a note."""

import argparse
import json
import sys

from strop.config import add_config_arguments, config_from_args
from strop.errors import UserError
from strop.outputs import claiming


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--policy", help="model directory to start from (default: <run_dir>/midtrain/model)")
    parser.add_argument("--base", help="the old name of --policy (deprecated)")


def run(args: argparse.Namespace) -> int:
    from strop.env.harness.loop import harness_config
    from strop.model.policy import is_model_dir
    from strop.train.sft import sft

    if args.base is not None:
        if args.policy is not None:
            raise UserError("--base is the old name of --policy: pass one of them")
        print("strop sft: --base is deprecated; it is now --policy, as for strop train", file=sys.stderr)
    start = args.policy or args.base
    cfg = config_from_args(args)
    harness_config(cfg.rollout, cfg.harness)  # a bad [harness] is refused before any model loads
    base = start or cfg.run_dir / "midtrain" / "model"
    with claiming(cfg.run_dir / "sft", "sft") as out:  # it overwrites model/ and its caches in there
        if not is_model_dir(base) and not (out / "result.json").is_file():  # refused: nothing left behind
            if start:
                raise UserError(f"no policy at {str(base)!r} (a model directory: config.json and *.safetensors)")
            raise UserError(f"no policy at {str(base)!r}; run `strop midtrain` first or pass --policy DIR")
    print(json.dumps(sft(cfg, start), indent=2))
    return 0
