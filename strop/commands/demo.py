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
from strop.cpu import describe, describe_line
from strop.errors import UserError
from strop.outputs import claim_dir, remove_output, write_atomic

DEFAULT_CONFIG = "examples/demo.toml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.set_defaults(config=DEFAULT_CONFIG)
    parser.add_argument("--fresh", action="store_true", help="delete the run directory first and rerun every stage")


def stage_midtrain(cfg: Config) -> dict:
    from strop.train.eval_midtrain import evaluate
    from strop.train.midtrain import midtrain

    claim_dir(cfg.run_dir / "midtrain", "midtrain")
    trained = midtrain(cfg)
    figures = evaluate(cfg.run_dir / "midtrain" / "model")
    return {**trained, **figures}


def _held_out(cfg: Config, model_dir: Path) -> dict:
    """The held-out evaluation of a stage's policy, kept beside it (`eval.json`) so that a rerun
    after an interruption does not evaluate it again."""
    from strop.rl.evaluate import evaluate
    from strop.rl.rollout_log import RolloutLog

    path = model_dir.parent / "eval.json"
    if path.is_file():
        return json.loads(path.read_text())
    kept = RolloutLog(model_dir.parent / "rollouts", cfg.log.rollouts_max_mb) if cfg.log.rollouts else None
    figures = evaluate(cfg, str(model_dir), progress=True, samples=cfg.rollout.eval_samples, rollouts=kept)
    write_atomic(path, json.dumps(figures, indent=2))
    return figures


def stage_sft(cfg: Config) -> dict:
    """SFT warm start on oracle demonstrations (early-stopped), then its held-out solve rate."""
    from strop.train.sft import sft

    claim_dir(cfg.run_dir / "sft", "sft")
    trained = sft(cfg)
    return {**_held_out(cfg, cfg.run_dir / "sft" / "model"), "train": trained}


def stage_rl(cfg: Config) -> dict:
    """Asynchronous RL from the SFT policy, then its held-out solve rate."""
    from strop.runtime.cpus import split_cores
    from strop.runtime.rl_run import train_rl

    cpus = split_cores(share=True)  # the trainer in a process of its own; it and the engines on every core
    hint = "`strop demo --fresh` runs every stage again"  # a stage interrupted under another config
    trained = train_rl(cfg, mode="async", cpus=cpus, trainer_process=cpus is not None, hint=hint)
    return {**_held_out(cfg, cfg.run_dir / "rl" / "model"), "train": trained}


def stage_report(cfg: Config) -> dict:
    """`report.md` with plots: the RL run's curves and both held-out evaluations."""
    from strop.rl.report import solve_rate_gains, write_report

    evals = {name: json.loads((cfg.run_dir / name / "eval.json").read_text()) for name in ("sft", "rl")}
    path = write_report(cfg.run_dir, cfg.run_dir / "rl" / "metrics.jsonl", evals)
    return {"path": str(path), "solve_rate_gain": solve_rate_gains(evals)}


# (name, function), run in order; each stage's result becomes summary[name].
STAGES: list[tuple[str, Callable[[Config], dict]]] = [
    ("midtrain", stage_midtrain),
    ("sft", stage_sft),
    ("rl", stage_rl),
    ("report", stage_report),
]


def read_summary(path: Path) -> dict:
    """The stages a previous demo run finished (empty for a new run), or UserError when the file is
    damaged: its stages cannot be trusted as cached."""
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text())
        stages = [summary[name] for name, _ in STAGES if name in summary] if isinstance(summary, dict) else [None]
        if not all(isinstance(s, dict) and isinstance(s.get("wall_s"), (int, float)) for s in stages):
            raise ValueError("not a summary of stages")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(
            f"{str(path)!r} is damaged ({type(e).__name__}); `strop demo --fresh` runs every stage again"
        ) from None
    return summary


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    if not Path(args.config).is_file():
        raise UserError(f"demo config {args.config!r} not found; run `make demo` from the repository root")
    cfg = load_config(args.config, args.overrides)
    set_threads(cfg.run.threads or None)
    summary_path = cfg.run_dir / "summary.json"
    if args.fresh:  # stages also keep their own results (models, eval.json): start clean
        remove_output(cfg.run_dir, "demo")  # only a run directory the demo made
    claim_dir(cfg.run_dir, "demo")  # new, empty or the demo's own: never a folder of the user's
    summary = read_summary(summary_path)
    cpu = describe()
    print(f"[demo] cpu: {describe_line(cpu)}", flush=True)
    t_demo = time.perf_counter()
    for name, fn in STAGES:
        if name in summary:
            print(f"[demo] {name}: cached ({summary[name]['wall_s']:.0f} s when it ran)")
            continue
        print(f"[demo] {name} ...", flush=True)
        t0 = time.perf_counter()
        result = fn(cfg)
        summary[name] = {**result, "wall_s": round(time.perf_counter() - t0, 1)}
        write_atomic(summary_path, json.dumps(summary, indent=2))
        print(f"[demo] {name}: done in {summary[name]['wall_s']:.0f} s")
    summary["cpu"] = cpu  # the machine of this (last) session
    write_atomic(summary_path, json.dumps(summary, indent=2))
    print(f"[demo] finished in {time.perf_counter() - t_demo:.0f} s on {describe_line(cpu)}; summary: {summary_path}")
    print(json.dumps(summary, indent=2))
    return 0
