"""`strop bench curriculum --policy DIR --json F`: RL at the policy's edge against uniform sampling,
on the same synthesized tasks, with the same steps and seed.

The tasks: unless `--tasks FILE` names a task file, `strop tasks synth` on a repository made here of
the `synthetic` suite's function library (`strop.env.suites.synthetic.library_files`: every theme,
real pytest tests with expected values from the correct code), on the host's root; its held-out split
is by function. The policy (`--policy`, e.g. the demo's RL model) first gets a held-out evaluation;
then RL runs twice from it in `sync` mode (a step's draws depend only on the outcomes before it),
`rl.curriculum = uniform` and `edge` (`strop.rl.curriculum`), `--steps` steps each, and each final
policy is evaluated on the same held-out tasks. Per arm: the fraction of trained groups with a
non-zero advantage (samples that did not all get the same reward: the groups RL learns from), the
training solve rate, and the held-out solve rate with its 95% interval. JSON: `start`, `uniform`,
`edge` with those figures, and the settings.
"""

import argparse
import os
import time
from pathlib import Path

# the demo's RL recipe, over every difficulty synth makes (1 bug, 2 or 3 combined)
BENCH = ["rollout.difficulties=[1,2,3]", "rollout.eval_difficulties=[1]", "rollout.train_tasks=10000"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from strop.config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--policy", required=True, help="model directory RL starts from (e.g. runs/demo/rl/model)")
    parser.add_argument("--tasks", help="task file to train and evaluate on (default: synthesized from a library)")
    parser.add_argument("--steps", type=int, default=20, help="RL steps per arm (default 20)")
    parser.add_argument("--eval-episodes", type=int, default=100, help="held-out episodes per evaluation (100)")
    parser.add_argument("--out", default="runs/bench-curriculum", help="working directory")
    parser.add_argument("--json", help="write results to this JSON file")


def library_tasks(out: Path) -> Path:
    """Tasks synthesized from the synthetic suite's library as a repository (made once in `out`)."""
    from strop.env.suites.synthetic import MODULES, library_files
    from strop.env.tasks.synth import synth
    from strop.env.world.repo import git

    tasks = out / "library.jsonl"
    if tasks.is_file():
        return tasks
    repo = out / "library"
    if not (repo / ".git").is_dir():
        for rel, text in library_files(tuple(MODULES)).items():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
        git("init", "-q", "-b", "main", cwd=repo)
        git("add", "-A", cwd=repo)
        git("commit", "-q", "-m", "the synthetic suite's library", cwd=repo)
    synth(str(repo), tasks, jobs=2, per_function=6)
    return tasks


def arm(cfg, policy: str, out: Path, tasks) -> dict:
    """One RL run from `policy` under `cfg` and its final policy's held-out evaluation."""
    from strop.outputs import remove_output
    from strop.report import MetricsLog
    from strop.rl.evaluate import evaluate
    from strop.runtime.rl_run import train_rl

    remove_output(out, "train")  # a previous run of this arm
    run = train_rl(cfg, mode="sync", policy_dir=policy, out_dir=out, quiet=True)
    rows = MetricsLog(out / "metrics.jsonl").read()
    groups = sum(r["groups"] for r in rows)
    held_out = evaluate(cfg, str(out / "model"), tasks)
    return {
        "steps": run["steps"],
        "groups": groups,
        "nonzero_advantage": round(sum(r["mixed_groups"] * r["groups"] for r in rows) / groups, 3),
        "train_solve_rate": round(sum(r["solve_rate"] for r in rows) / len(rows), 3),
        **_held_out(held_out),
    }


def _held_out(ev: dict) -> dict:
    return {
        "solve_rate": ev["solve_rate"],
        "solve_rate_ci95": ev["solve_rate_ci95"],
        "eval_episodes": ev["eval_episodes"],
    }


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(1)
    from strop.bench.table import format_table, write_json
    from strop.config import load_config
    from strop.errors import UserError
    from strop.outputs import claim_dir

    if args.steps < 1 or args.eval_episodes < 1:
        raise UserError("bench curriculum: --steps and --eval-episodes must be at least 1")
    out = claim_dir(Path(args.out), "bench curriculum")
    t0 = time.perf_counter()
    tasks_file = Path(args.tasks).resolve() if args.tasks else library_tasks(out).resolve()
    sets = [*BENCH, f"rollout.suite=jsonl:{tasks_file}", f"rl.steps={args.steps}"]
    cfg = load_config(args.config, sets + [f"rollout.eval_episodes={args.eval_episodes}", *args.overrides])
    from dataclasses import replace

    from strop.rl.evaluate import eval_tasks, evaluate

    held_out = eval_tasks(cfg)
    results = {"start": {"steps": 0, **_held_out(evaluate(cfg, args.policy, held_out))}}
    for curriculum in ("uniform", "edge"):
        arm_cfg = replace(cfg, rl=replace(cfg.rl, curriculum=curriculum))
        results[curriculum] = arm(arm_cfg, args.policy, out / curriculum, held_out)
        print(f"[bench curriculum] {curriculum}: {results[curriculum]}", flush=True)
    rows = [{"policy": k, **{f: v for f, v in r.items() if f != "solve_rate_ci95"}} for k, r in results.items()]
    for row, r in zip(rows, results.values()):
        row["ci95"] = "[{:.3f}, {:.3f}]".format(*r["solve_rate_ci95"])
    print(
        f"uniform vs edge curriculum, {args.steps} sync steps each from {args.policy}, on {tasks_file} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    columns = ["policy", "steps", "groups", "nonzero_advantage", "train_solve_rate", "solve_rate", "ci95"]
    print(format_table(rows, [*columns, "eval_episodes"]))
    write_json(
        args.json,
        {
            **results,
            "policy": args.policy,
            "tasks": str(tasks_file),
            "steps": args.steps,
            "seed": cfg.run.seed,
            "group_size": cfg.rl.group_size,
            "batch_groups": cfg.rl.batch_groups,
            "curriculum_explore": cfg.rl.curriculum_explore,
            "load_avg_1m": round(os.getloadavg()[0], 2),
        },
    )
    return 0
