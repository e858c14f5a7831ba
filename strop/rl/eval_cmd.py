"""`strop eval policy --policy DIR [--config F] [--set rollout.eval_episodes=50] [--json F]`: the
held-out solve rate of any saved policy, exactly as the demo measures its stages (greedy unless
`rollout.eval_temperature` says otherwise), overall and per difficulty with 95% intervals, and how
the episodes ended: a policy that learned to quit shows up as `no_tool_call` stops, and one whose
edits never apply as `no changes` outcomes.
"""

import argparse
import json

from strop.config import add_config_arguments, config_from_args
from strop.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--policy", required=True, help="model directory (e.g. runs/demo/sft/model)")
    parser.add_argument("--json", help="also write the figures to this JSON file")


def run(args: argparse.Namespace) -> int:
    from strop.bench.table import format_table, write_json
    from strop.model.policy import is_model_dir
    from strop.rl.evaluate import evaluate
    from strop.threads import set_threads

    cfg = config_from_args(args)
    if not is_model_dir(args.policy):
        raise UserError(f"no policy at {args.policy!r} (a directory with config.json and *.safetensors)")
    set_threads(cfg.run.threads or None)
    result = evaluate(cfg, args.policy, progress=True)
    rows = [{"difficulty": d, "solved": round(v["solve_rate"] * v["eval_episodes"]), "episodes": v["eval_episodes"],
             "solve_rate": v["solve_rate"], "ci95": str(v["solve_rate_ci95"])}
            for d, v in [("all", result), *result["by_difficulty"].items()]]
    print(format_table(rows, ["difficulty", "solved", "episodes", "solve_rate", "ci95"]))
    print(f"temperature {cfg.rollout.eval_temperature:g}; hack-flagged {result['hacked']}; "
          f"stops {json.dumps(result['stop_reasons'])}; {result['wall_s']} s")
    print(f"outcomes {json.dumps(result['outcomes'])}")
    write_json(args.json, {"policy": args.policy, "temperature": cfg.rollout.eval_temperature, **result})
    return 0
