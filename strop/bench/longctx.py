"""`strop bench longctx`: context strategies on the long-horizon `chain` suite's held-out split.

Every strategy of `strop.env.harness.context` runs the same held-out chain tasks through the real harness,
tools, sandbox and checker in a small window (`--window`, 2,048 tokens by default), and reports for
each: solve rate with its 95% Wilson interval, episodes, mean checker reward with its 95% interval
(the share of a chain's hidden checks passed, which moves before the solve rate does), resets per
episode (and the fewest), carried-state tokens per reset, tokens per episode (all windows), the
whole conversation's tokens as a multiple of the window, and compaction error
(`strop.env.harness.context.facts_lost`: the share of needed keys, already shown by a tool, that a carried
state no longer holds).

By default the policy is the chain demonstrator (`strop.env.demonstrators.chain`), a scripted agent that
knows only what its window shows; "learned" is the "summarize" strategy with the demonstrator
writing its own summaries — the prompted summary SFT would teach, before any RL. The numbers then
show what each strategy carries for an agent that needs it, not what RL learns.

`--policy DIR` plays a trained model instead, through held-out evaluation (`strop.rl.evaluate`:
engines, harness, sandbox and checker as in training; `--config`/`--set` choose its rollout
settings, greedy unless `rollout.eval_temperature` says otherwise), one run per strategy with
`rollout.context_strategy` set to it; "learned" is then the policy's own summaries, and a policy
after RL against its warm start is the before/after comparison. The JSON also keeps each strategy's
episodes per task id (`episodes`: solved, stop reason, summaries) and every chain's keys (`facts`), and
`--before F --report R` writes the long-horizon report (`strop.bench.longctx_report`): this run
against an earlier one's JSON, with their summaries side by side.
"""

import argparse
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from strop.config import add_config_arguments, config_from_args

STRATEGIES = {"learned": "summarize", "truncation": "truncation", "masking": "masking", "compaction": "compaction"}
MAX_RESETS = 32


def turn_tokens(stages: int) -> int:
    """The bound on a turn and on a summary for chains of `stages` stages: the demonstrator's longest
    of each (write_file with every key: 94, 152 and 320 tokens at 4, 12 and 32 stages with the
    default tokenizer; a summary holding every key: 95, 149, 303) grows by ~8 tokens a key, and every
    token reserved is window a stage file cannot use."""
    return 84 + 8 * stages


def max_turns(stages: int) -> int:
    """Turns an episode may take: a chain needs one read per stage, a write and a submit; twice that
    lets an agent that lost keys read the whole chain again once."""
    return 2 * (stages + 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="16 episodes per strategy instead of 200")
    parser.add_argument("--episodes", type=int, help="held-out episodes per strategy (default 200, 16 with --quick)")
    parser.add_argument("--difficulty", type=int, default=3, help="chain difficulty (1: 4 stages, 2: 12, 3: 32)")
    parser.add_argument("--window", type=int, default=2048, help="context window in tokens")
    parser.add_argument(
        "--workers", type=int, default=2, help="episodes run at once (the demonstrator; --policy uses rollout.workers)"
    )
    parser.add_argument(
        "--tokenizer", help="tokenizer directory (default: the configured vocabulary, trained on 2 MB of the corpus)"
    )
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help=f"comma-separated, of {', '.join(STRATEGIES)} (default all)"
    )
    parser.add_argument("--json", help="write results to this JSON file")
    parser.add_argument("--before", help="an earlier --policy run's JSON (the warm start's), for --report")
    parser.add_argument("--report", help="write the long-horizon report (markdown) of --before against this run")
    parser.add_argument(
        "--policy", help="a trained model directory to play instead of the scripted demonstrator (see above)"
    )
    add_config_arguments(parser)


def harness_settings(stages: int, window: int) -> dict:
    """The harness's long-context settings for chains of `stages` stages in a `window`-token window."""
    return {
        "max_context": window,
        "max_turn_tokens": turn_tokens(stages),
        "max_turns": max_turns(stages),
        "max_resets": MAX_RESETS,
        "summary_tokens": turn_tokens(stages),
    }


def figures(rewards: list[float], contexts: list[dict], stops: list[str]) -> dict:
    """One strategy's row from its episodes' checker rewards and `episode_context` records."""
    from strop.env.harness.context import context_figures
    from strop.rl.evaluate import rate_figures, reward_figures

    return {
        **rate_figures([r >= 1.0 for r in rewards]),
        **reward_figures(rewards),
        **context_figures(contexts),
        "stop_reasons": dict(Counter(stops)),
    }


def measure(tasks: list, tokenizer, strategy: str, window: int, workers: int) -> dict:
    """One strategy's figures over `tasks`, played by the chain demonstrator (see the module docstring)."""
    from strop.env.demonstrators.chain import ChainDemonstrator
    from strop.env.grading.checker import check, source_changes
    from strop.env.harness.context import episode_context
    from strop.env.harness.loop import Harness, HarnessConfig, run_task

    settings = harness_settings(len(tasks[0].metadata["facts"]), window)
    harness = Harness(tokenizer, HarnessConfig(context_strategy=strategy, **settings))

    def one(task) -> tuple:
        episode, changes = run_task(harness, ChainDemonstrator(task, harness.format), task)
        changes = source_changes(changes)
        reward = check(task, changes, perturbed=False).reward if changes else 0.0
        record = episode_context(episode, task.metadata["facts"])
        return reward, record, episode.stop_reason, harness.count(episode.messages)

    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(one, tasks))
    out = figures([r[0] for r in results], [r[1] for r in results], [r[2] for r in results])
    out["window_multiple"] = sum(r[3] for r in results) / len(results) / window
    return out


def measure_policy(cfg, policy: str, tasks: list, strategy: str, window: int) -> dict:
    """One strategy's figures over `tasks`, played by the model in `policy` through held-out
    evaluation, with its summaries per task id."""
    from strop.rl.evaluate import evaluate

    settings = harness_settings(len(tasks[0].metadata["facts"]), window)
    cfg = replace(cfg, rollout=replace(cfg.rollout, suite="chain", context_strategy=strategy, **settings))
    result = evaluate(cfg, policy, tasks, progress=True)
    return {
        **{k: result[k] for k in ("solve_rate", "solve_rate_ci95", "eval_episodes", "reward_mean", "reward_ci95")},
        **result["context"],
        "stop_reasons": result["stop_reasons"],
        "episodes": result["episodes"],
    }


def run(args: argparse.Namespace) -> int:
    from strop.bench.table import format_table, write_json
    from strop.data.tokenizer import load_tokenizer
    from strop.env.demonstrators.runs import default_tokenizer
    from strop.env.tasks.suites import load_suite
    from strop.errors import UserError
    from strop.threads import set_threads

    episodes = args.episodes if args.episodes is not None else 16 if args.quick else 200
    if episodes < 1 or args.workers < 1:
        raise UserError(f"--episodes and --workers must be >= 1, got {episodes} and {args.workers}")
    chosen = [name.strip() for name in args.strategies.split(",") if name.strip()]
    if not chosen or set(chosen) - set(STRATEGIES):
        raise UserError(f"--strategies must name some of {', '.join(STRATEGIES)}, got {args.strategies!r}")
    before = _before(args, chosen)
    tasks = load_suite("chain", "eval", difficulty=args.difficulty, limit=episodes)
    if args.policy:
        from strop.model.policy import is_model_dir

        if not is_model_dir(args.policy):
            raise UserError(f"no policy at {args.policy!r} (a directory with config.json and *.safetensors)")
        cfg = config_from_args(args)
        set_threads(cfg.run.threads or None)
        who = f"the model in {args.policy} ('learned' = its own summaries)"
    else:
        set_threads(1)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else default_tokenizer()
        who = "chain demonstrator (scripted); learned = summarize with its own summaries, before RL"

    def play(strategy: str) -> dict:
        if args.policy:
            return measure_policy(cfg, args.policy, tasks, strategy, args.window)
        return measure(tasks, tokenizer, strategy, args.window, args.workers)

    rows, out = [], {}
    for name in chosen:
        strategy, start = STRATEGIES[name], time.perf_counter()
        out[name] = play(strategy)
        rows.append(
            {
                "strategy": name,
                **{k: v for k, v in out[name].items() if k not in ("stop_reasons", "episodes")},
                "seconds": time.perf_counter() - start,
            }
        )
        print(f"{name}: solved {out[name]['solve_rate']:.1%} of {len(tasks)} ({rows[-1]['seconds']:.0f} s)", flush=True)
    print(
        f"context strategies on chain/eval difficulty {args.difficulty} ({len(tasks)} episodes each), window "
        f"{args.window} tokens; policy: {who}"
    )
    print(
        format_table(
            rows,
            [
                "strategy",
                "solve_rate",
                "solve_rate_ci95",
                "eval_episodes",
                "reward_mean",
                "resets_mean",
                "resets_min",
                "carried_tokens_mean",
                "compaction_error",
                "tokens_per_episode",
                "window_multiple",
            ],
        )
    )
    result = {
        "suite": "chain",
        "split": "eval",
        "difficulty": args.difficulty,
        "window": args.window,
        "policy": args.policy or who,
        "strategies": out,
        "facts": {t.id: t.metadata["facts"] for t in tasks},
    }
    write_json(args.json, result)
    if args.report:
        from strop.bench.longctx_report import render
        from strop.outputs import write_atomic

        write_atomic(args.report, render(before, result) + "\n")
        print(f"report: {args.report}")
    return 0


def _before(args: argparse.Namespace, chosen: list[str]) -> dict | None:
    """The --before run for --report, checked before anything runs (None without --report)."""
    import json
    from pathlib import Path

    from strop.errors import UserError
    from strop.outputs import check_output_file

    if not args.report:
        if args.before:
            raise UserError("--before is only read by --report")
        return None
    if not (args.policy and args.before and "learned" in chosen):
        raise UserError("--report needs --policy, --before (a --policy run's JSON) and the 'learned' strategy")
    check_output_file(args.report)
    try:
        before = json.loads(Path(args.before).read_text())
        before["strategies"]["learned"]["episodes"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = f"--before {args.before!r} is not a `bench longctx --policy` JSON with 'learned'"
        raise UserError(f"{what}: {e}") from None
    if (before.get("difficulty"), before.get("window")) != (args.difficulty, args.window):
        raise UserError(
            f"--before ran difficulty {before.get('difficulty')} in a {before.get('window')}-token window; "
            f"this run is difficulty {args.difficulty} in {args.window}"
        )
    return before
