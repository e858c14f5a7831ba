"""`strop train --config F [--mode sync|async] [--runtime inline|ray]`: RL from a warm-started policy.

Parses the command line and hands the run to `strop.runtime.rl_run.train_rl`, which builds and runs
(or resumes) it; prints the run's figures as JSON. Rerun on the same output directory with the same
config it resumes (or, finished, reports); with another config it is refused with what changed,
unless `--resume` or `--force` says what to do.
"""

import argparse
import json

from strop.config import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--mode",
        choices=["sync", "async"],
        default="async",
        help="async: rollouts on the newest weights while the trainer steps; sync: generate, train, sync",
    )
    parser.add_argument(
        "--runtime",
        choices=["inline", "ray"],
        default="inline",
        help="inline: one machine (on 2+ cores the trainer runs in a child process, "
        "engines and rollouts on every core); ray: trainer, engines and rollout workers as Ray actors",
    )
    parser.add_argument("--ray-address", help="join this Ray cluster (default: start a local Ray instance)")
    parser.add_argument("--policy", help="model directory to start from (default: <run_dir>/sft/model)")
    parser.add_argument("--out", help="output directory (default: <run_dir>/rl)")
    rerun = parser.add_mutually_exclusive_group()
    rerun.add_argument(
        "--resume",
        action="store_true",
        help="when --out holds a run made with another config: go on from its last checkpoint under this "
        "one (a finished run trains on to the new rl.steps); not for another model, mode or policy",
    )
    rerun.add_argument(
        "--force",
        action="store_true",
        help="when --out holds a run (made by `strop train`): delete it and start again",
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from strop.data.tokenizer import load_tokenizer
    from strop.env.harness.loop import Harness, harness_config
    from strop.runtime.cpus import split_cores
    from strop.runtime.rl_run import train_rl
    from strop.threads import set_threads

    cfg = config_from_args(args)
    declared = harness_config(cfg.rollout, cfg.harness)  # a bad [harness] is refused before any model loads
    policy = Path(args.policy or cfg.run_dir / "sft" / "model")
    if (policy / "tokenizer.json").is_file():  # and a chat template that is not append-only, before any work
        Harness(load_tokenizer(policy), declared)
    set_threads(cfg.run.threads or None)
    cpus = split_cores(share=True) if args.runtime == "inline" else None  # the trainer in a process of its own
    result = train_rl(
        cfg,
        mode=args.mode,
        runtime=args.runtime,
        policy_dir=args.policy,
        out_dir=args.out,
        ray_address=args.ray_address,
        cpus=cpus,
        trainer_process=cpus is not None,
        on_change="resume" if args.resume else "force" if args.force else "refuse",
    )
    print(json.dumps(result, indent=2))
    return 0
