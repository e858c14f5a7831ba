"""`strop online`: the online RL cycle against running `strop serve` engines (`strop.online.cycle`).

    strop online --once      --checkpoint BASE --store DB --weights-store W --engine URL [...]
    strop online --interval 5h ...        the same cycle every interval until Ctrl-C / SIGTERM
    strop online --simulate N --json F    the whole loop end to end with simulated users
                                          (`strop.online.simulate`): a real server, real HTTP, real database
    strop online --simulate N --checkpoint DIR --config F
                                          ... serving and training DIR (a pretrained model) instead
                                          of the mixture policy trained here

`--config F`: the run config's `[harness]` chat template and tool parser are what the gates (and a
simulation's server) render in, and its `trainer.frozen_layers` what the update leaves frozen.

The admin key the cycle presents to the engines comes from $STROP_API_KEY. Each cycle prints one
JSON line (its report without the bulky figures); `--json F` writes the whole report.
"""

import argparse
import json
import os
import re
import time
from pathlib import Path

from strop.errors import UserError

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--once", action="store_true", help="run one cycle and exit")
    mode.add_argument("--interval", help="run a cycle every interval, e.g. 5h, 30m, 90s")
    mode.add_argument("--simulate", type=int, metavar="N", help="N cycles with simulated users (everything made here)")
    parser.add_argument(
        "--checkpoint",
        help="the base policy directory (architecture, tokenizer); with --simulate, the policy served and "
        "trained (default: a mixture policy trained here)",
    )
    parser.add_argument(
        "--config", help="a run config: its [harness] chat template and tool parser, its trainer.frozen_layers"
    )
    parser.add_argument("--store", help="feedback store the engines log to (SQLite path or postgresql:// URL)")
    parser.add_argument("--weights-store", help="the run's weight store the engines load from")
    parser.add_argument("--engine", action="append", help="a serving engine's URL (repeatable)")
    parser.add_argument(
        "--run-dir", default="runs/online", help="trainer states, version directories, simulation files"
    )
    parser.add_argument(
        "--rewards", default="", help="override Tab-style rewards: kind.value=reward,... (e.g. accept.reject=-0.5)"
    )
    parser.add_argument("--lr", type=float, default=3e-4, help="learning rate of the cycle's update")
    parser.add_argument(
        "--max-staleness", type=int, default=1, help="ratings of versions this far behind the served one count"
    )
    parser.add_argument("--min-rated", type=int, default=16, help="a cycle waits until this many new ratings")
    parser.add_argument(
        "--gate-suites", default="synthetic,humaneval,mutated", help="held-out task suites the gates run"
    )
    parser.add_argument("--gate-episodes", type=int, default=6, help="episodes per gate suite")
    parser.add_argument("--probe-samples", type=int, default=2, help="samples per probe request of the gates' monitors")
    parser.add_argument(
        "--requests", type=int, default=384, help="--simulate: requests per cycle (the ratings one update trains on)"
    )
    parser.add_argument("--users", type=int, default=8, help="--simulate: simulated users")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the gates' sampling (with --simulate, of the policy and users too)"
    )
    parser.add_argument("--json", help="write the report (all cycles) here")


def seconds(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"--interval {text!r}: write a positive number with s, m, h or d (e.g. 5h)")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


def open_store(url: str):
    from strop.online.store import Store

    try:
        return Store(url)
    except ValueError as e:
        raise UserError(str(e)) from None


def run_config(args: argparse.Namespace):
    """(the harness's chat template, its tool parser, trainer.frozen_layers) of `--config`, checked."""
    from strop.config import load_config
    from strop.env.harness.loop import harness_config

    cfg = load_config(args.config)
    harness = harness_config(cfg.rollout, cfg.harness)  # a template that is not a file: refused here
    return harness.chat_template, harness.tool_parser, cfg.trainer.frozen_layers


def gate_settings(args: argparse.Namespace, chat_template: str, tool_parser: str):
    from strop.online.gates import SUITES, GateSettings

    suites = tuple(s.strip() for s in args.gate_suites.split(",") if s.strip())
    bad = [s for s in suites if s not in SUITES]
    if bad:
        raise UserError(f"--gate-suites: {bad[0]!r} is not one of {', '.join(SUITES)}")
    if args.gate_episodes < 1 or args.probe_samples < 1:
        raise UserError("--gate-episodes and --probe-samples must be at least 1")
    return GateSettings(
        suites=suites,
        episodes=args.gate_episodes,
        probe_samples=args.probe_samples,
        seed=args.seed,
        chat_template=chat_template,
        tool_parser=tool_parser,
    )


def settings_from(args: argparse.Namespace):
    """The cycle's settings from the command line (shared with `strop online rollback`)."""
    from strop.config import RLSection
    from strop.online.cycle import CycleSettings
    from strop.online.rewards import RewardMap

    key = os.environ.get("STROP_API_KEY")
    if not key:
        raise UserError("set $STROP_API_KEY to an admin key of the engines (`strop serve key --scopes admin,infer`)")
    try:
        rewards = RewardMap.parse(getattr(args, "rewards", ""))
    except ValueError as e:
        raise UserError(f"--rewards: {e}") from None
    extra = {}
    if hasattr(args, "lr"):
        if args.lr <= 0 or args.max_staleness < 0 or args.min_rated < 2:
            raise UserError("need --lr > 0, --max-staleness >= 0 and --min-rated >= 2")
        chat_template, tool_parser, frozen_layers = run_config(args)
        extra = {
            "rl": RLSection(lr=args.lr, micro_batch=16, measure_every=0),
            "max_staleness": args.max_staleness,
            "min_rated": args.min_rated,
            "gates": gate_settings(args, chat_template, tool_parser),
            "frozen_layers": frozen_layers,
        }
    return CycleSettings(
        checkpoint=args.checkpoint,
        weights=args.weights_store,
        engines=args.engine,
        admin_key=key,
        run_dir=Path(args.run_dir),
        rewards=rewards,
        **extra,
    )


def _summary(report: dict) -> dict:
    return {
        k: v
        for k, v in report.items()
        if k not in ("candidate_figures", "current_figures", "served_figures", "traffic_monitors", "engines")
    }


def run_simulation(args: argparse.Namespace) -> dict:
    from strop.config import DataSection
    from strop.data.corpus import load_corpus
    from strop.data.tokenizer import train_tokenizer
    from strop.online.simulate import simulate
    from strop.threads import set_threads

    if args.simulate < 1 or args.requests < 8 or args.users < 1:
        raise UserError("need --simulate >= 1, --requests >= 8 and --users >= 1")
    set_threads(1)
    run_dir = Path(args.run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"--run-dir {run_dir} is not empty; a simulation starts from nothing")
    chat_template, tool_parser, frozen_layers = run_config(args)
    gates = gate_settings(args, chat_template, tool_parser)
    if args.checkpoint:
        from strop.model.policy import load_model_config

        load_model_config(args.checkpoint)  # not a model directory: refused before the server starts
        tokenizer = None
    else:
        corpus = load_corpus(DataSection(val_files=5))
        tokenizer = train_tokenizer(corpus.train[:200], vocab_size=512, sample_bytes=400_000)
    report = simulate(
        args.simulate,
        run_dir,
        tokenizer,
        requests=args.requests,
        users=args.users,
        lr=args.lr,
        gates=gates,
        base=args.checkpoint,
        frozen_layers=frozen_layers,
        seed=args.seed,
    )
    print(
        json.dumps(
            {
                k: report[k]
                for k in (
                    "approval",
                    "approval_ci95",
                    "rises_outside_ci95",
                    "all_gates_passed",
                    "blocked_harmful",
                    "rollback_bitwise",
                    "wall_s",
                )
            }
        )
    )
    return report


def run(args: argparse.Namespace) -> int:
    if args.simulate is not None:
        report = run_simulation(args)
    else:
        missing = [
            f"--{n.replace('_', '-')}"
            for n in ("checkpoint", "store", "weights_store", "engine")
            if not getattr(args, n)
        ]
        if missing:
            raise UserError(f"a cycle needs {', '.join(missing)}")
        from strop.online.cycle import initialize, run_cycle
        from strop.threads import set_threads

        set_threads(None)
        s = settings_from(args)
        every = seconds(args.interval) if args.interval else None
        store = open_store(args.store)
        cycles = []
        try:
            initialize(s, store)
            while True:
                started = time.monotonic()
                report = run_cycle(s, store, log=print)
                cycles.append(report)
                print(json.dumps(_summary(report)), flush=True)
                if every is None:
                    break
                time.sleep(max(0.0, every - (time.monotonic() - started)))
        except ValueError as e:  # an engine refused or is unreachable, a version the store cannot rebuild
            raise UserError(str(e)) from None
        finally:
            store.close()
        report = {"cycles": cycles}
    if args.json:
        from strop.outputs import write_atomic

        write_atomic(args.json, json.dumps(report, indent=1) + "\n")
    return 0
