"""`strop demo`: the tiny end-to-end pipeline on one CPU machine.

Stages run in order; a finished stage is cached (its summary object is kept and its outputs are
reused), so a rerun only does what is missing or was interrupted. Every stage adds one object to
`<run_dir>/summary.json` with its key figures and `wall_s`.
"""

import argparse
import json
import time
from pathlib import Path
from typing import Callable

from strop.config import Config, add_config_arguments, load_config
from strop.errors import UserError

DEFAULT_CONFIG = "examples/demo.toml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.set_defaults(config=DEFAULT_CONFIG)
    parser.add_argument("--fresh", action="store_true", help="ignore cached stages and rerun everything")


def stage_midtrain(cfg: Config) -> dict:
    from strop.train.eval_midtrain import evaluate
    from strop.train.midtrain import midtrain

    trained = midtrain(cfg)
    figures = evaluate(cfg.run_dir / "midtrain" / "model")
    return {**trained, **figures}


# (name, function), run in order; each stage's result becomes summary[name].
STAGES: list[tuple[str, Callable[[Config], dict]]] = [
    ("midtrain", stage_midtrain),
]


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    if not Path(args.config).is_file():
        raise UserError(f"demo config {args.config!r} not found; run `make demo` from the repository root")
    cfg = load_config(args.config, args.overrides)
    set_threads(cfg.run.threads or None)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    summary_path = cfg.run_dir / "summary.json"
    summary = {} if args.fresh or not summary_path.is_file() else json.loads(summary_path.read_text())
    t_demo = time.perf_counter()
    for name, fn in STAGES:
        if name in summary:
            print(f"[demo] {name}: cached ({summary[name]['wall_s']:.0f} s when it ran)")
            continue
        print(f"[demo] {name} ...", flush=True)
        t0 = time.perf_counter()
        result = fn(cfg)
        summary[name] = {**result, "wall_s": round(time.perf_counter() - t0, 1)}
        summary_path.write_text(json.dumps(summary, indent=2))
        print(f"[demo] {name}: done in {summary[name]['wall_s']:.0f} s")
    print(f"[demo] finished in {time.perf_counter() - t_demo:.0f} s; summary: {summary_path}")
    print(json.dumps(summary, indent=2))
    return 0
