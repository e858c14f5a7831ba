"""`strop eval policy --policy DIR [--config F] [--set rollout.eval_episodes=50] [--json F]`: the
held-out solve rate of any saved policy, exactly as the demo measures its stages (greedy unless
`rollout.eval_temperature` says otherwise), overall and per difficulty with 95% intervals, and how
the episodes ended: a policy that learned to quit shows up as `no_tool_call` stops, and one whose
edits never apply as `no changes` outcomes. `--samples K` (default `rollout.eval_samples`, 1 in the
demo's config) also samples every task K times at the rollout temperature and reports pass@1 and
pass@K per difficulty: the headroom RL can sharpen. `--split train` plays the train tasks RL draws
instead (`rollout.train_start`, `rollout.train_tasks`): a policy that solves the tasks its SFT was
cloned from far more often than others has memorized their answers.
Behaviour statistics (turns, tool calls, rejected edits and whether the policy retried, test runs,
submits without testing) come with each. The episodes are kept (`log.rollouts`) in the run's
`eval/rollouts/`, replacing an earlier evaluation's: `strop runs show RUN --stage eval --eval greedy`.
"""

import argparse
import json

from strop.config import add_config_arguments, config_from_args
from strop.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--policy", required=True, help="model directory (e.g. runs/demo/sft/model)")
    parser.add_argument(
        "--samples",
        type=int,
        metavar="K",
        help="also sample each task K times at rollout.temperature: pass@1 and pass@K "
        "(default: rollout.eval_samples, as the demo evaluates)",
    )
    parser.add_argument(
        "--split",
        choices=("eval", "train"),
        default="eval",
        help="held-out tasks (rollout.eval_episodes per difficulty), or the train tasks RL draws",
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")


def run(args: argparse.Namespace) -> int:
    from strop.bench.table import format_table, write_json
    from strop.env.harness.loop import harness_config
    from strop.model.policy import is_model_dir
    from strop.rl.evaluate import evaluate
    from strop.rl.rollout_log import RolloutLog
    from strop.runtime.rl_run import train_tasks
    from strop.threads import set_threads

    cfg = config_from_args(args)
    harness_config(cfg.rollout, cfg.harness)  # a bad [harness] is refused before any model loads
    if not is_model_dir(args.policy):
        raise UserError(f"no policy at {args.policy!r} (a directory with config.json and *.safetensors)")
    samples = cfg.rollout.eval_samples if args.samples is None else args.samples
    if samples < 0:
        raise UserError(f"--samples must be >= 0, got {samples}")
    set_threads(cfg.run.threads or None)
    tasks = train_tasks(cfg) if args.split == "train" else None
    # the episodes are kept as a run's stages keep theirs (`log.rollouts`), in the run's eval/ stage
    kept = RolloutLog(cfg.run_dir / "eval" / "rollouts", cfg.log.rollouts_max_mb) if cfg.log.rollouts else None
    result = evaluate(cfg, args.policy, tasks, progress=True, samples=samples, rollouts=kept)
    rows = [
        {
            "difficulty": d,
            "solved": round(v["solve_rate"] * v["eval_episodes"]),
            "episodes": v["eval_episodes"],
            "solve_rate": v["solve_rate"],
            "ci95": str(v["solve_rate_ci95"]),
        }
        for d, v in [("all", result), *result["by_difficulty"].items()]
    ]
    columns = ["difficulty", "solved", "episodes", "solve_rate", "ci95"]
    if samples:
        k = samples
        sampled = [result["sampled"], *result["sampled"]["by_difficulty"].values()]
        for row, v in zip(rows, sampled):
            row.update(
                {
                    "pass@1": v["pass@1"],
                    "pass@1 ci95": str(v["pass@1_ci95"]),
                    f"pass@{k}": v["pass@k"],
                    f"pass@{k} ci95": str(v["pass@k_ci95"]),
                }
            )
        columns += ["pass@1", "pass@1 ci95", f"pass@{k}", f"pass@{k} ci95"]
    print(format_table(rows, columns))
    print(
        f"temperature {cfg.rollout.eval_temperature:g}; hack-flagged {result['hacked']}; "
        f"stops {json.dumps(result['stop_reasons'])}; {result['wall_s']} s"
    )
    print(f"outcomes {json.dumps(result['outcomes'])}")
    print(
        behaviour_table(
            {
                "greedy": result["behaviour"],
                **({f"T={cfg.rollout.temperature:g}": result["sampled"]["behaviour"]} if samples else {}),
            }
        )
    )
    write_json(args.json, {"policy": args.policy, "temperature": cfg.rollout.eval_temperature, **result})
    if kept is not None:
        print(f"episodes kept in {kept.dir} (strop runs show {cfg.run_dir} --stage eval --eval greedy)")
    return 0


def behaviour_table(summaries: dict[str, dict]) -> str:
    """Behaviour statistics of one or more evaluations side by side (`strop.env.grading.behaviour.summarize`)."""
    from strop.bench.table import format_table
    from strop.env.grading.behaviour import LABELS

    rows = []
    for key, label in LABELS.items():
        indent = "  " if key.startswith("retry_") else ""  # a rate given the row above
        rows.append({"behaviour": indent + label, **{name: s.get(key) for name, s in summaries.items()}})
    return format_table(rows, ["behaviour", *summaries])
