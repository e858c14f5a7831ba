"""`strop bench budget [--policy DIR] [--steps N] --json F`: where an RL step's seconds go, on the demo's
config and placement (`strop demo`'s RL stage: async, the trainer in its own process, trainer and
engines on every core), from a policy (default: the demo's SFT warm start, `runs/demo/sft/model`).

It runs N steps of RL into `--out` and prints the time budget `strop.rl.budget` logs per step:
the step's wall time, how long the loop waited for groups (generation on the critical path) and
how long the trainer call took; the trainer's forward, backward, optimizer and publish; the
engines' prefill, decode, other busy time, swaps and idle time; and the rollouts' sandbox, policy
(of which queueing for a slot), tool, harness, checker and monitor seconds. The first step is left
out of the means (it pays one-off costs: first sandboxes, kernel builds). JSON: `budget`
(`strop.rl.budget.budget_table`), `cpu` (`strop.cpu.describe`), `steps`, `load_avg_1m`.
"""

import argparse
import os
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from strop.config import add_config_arguments

    add_config_arguments(parser)
    parser.set_defaults(config="examples/demo.toml")
    parser.add_argument(
        "--policy", help="the policy to train (default: runs/<run.name>/sft/model, the demo's warm start)"
    )
    parser.add_argument("--steps", type=int, default=6, help="RL steps to run; the first is left out of the means")
    parser.add_argument("--out", default="runs/bench-budget", help="working directory (its RL run is replaced)")
    parser.add_argument("--json", help="write results to this JSON file")


def run(args: argparse.Namespace) -> int:
    from strop.bench.table import format_table, write_json
    from strop.config import config_from_args
    from strop.cpu import describe, describe_line
    from strop.errors import UserError
    from strop.outputs import claim_dir, remove_output

    if args.steps < 2:
        raise UserError("bench budget: --steps must be at least 2 (the first step is left out)")
    cfg = config_from_args(args)
    policy = Path(args.policy) if args.policy else cfg.run_dir / "sft" / "model"
    if not (policy / "config.json").is_file():
        raise UserError(f"no policy at {str(policy)!r}: run `make demo` (its SFT stage) first, or pass --policy DIR")
    out = claim_dir(Path(args.out), "bench budget")
    from dataclasses import replace

    from strop.report import MetricsLog
    from strop.rl.budget import budget_lines, budget_table
    from strop.runtime.cpus import split_cores
    from strop.runtime.rl_run import train_rl
    from strop.threads import set_threads

    set_threads(cfg.run.threads or None)
    cfg = replace(cfg, rl=replace(cfg.rl, steps=args.steps), rollout=replace(cfg.rollout, ckpt_every=10**6))
    remove_output(out / "rl", "train")
    cpus = split_cores(share=True)
    train_rl(cfg, policy_dir=policy, out_dir=out / "rl", cpus=cpus, trainer_process=cpus is not None, quiet=True)
    rows = MetricsLog(out / "rl" / "metrics.jsonl").read()[1:]
    budget = budget_table(rows)
    cpu = describe()
    print(f"an RL step's time budget: {cfg.rl.batch_groups} groups x {cfg.rl.group_size}, policy {policy}")
    print(f"cpu: {describe_line(cpu)}; load average {os.getloadavg()[0]:.2f}")
    print(format_table(budget["rows"], ["side", "part", "s_per_step", "what"]))
    print("\n".join(budget_lines(budget)[-2:]))
    write_json(
        args.json,
        {"budget": budget, "cpu": cpu, "steps": args.steps, "policy": str(policy), "load_avg_1m": os.getloadavg()[0]},
    )
    return 0
