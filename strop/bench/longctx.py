"""`strop bench longctx`: context strategies on the long-horizon `chain` suite's held-out split.

Every strategy of `strop.env.context` runs the same held-out chain tasks through the real harness,
tools, sandbox and checker in a small window (`--window`, 1k tokens by default), and reports for
each: solve rate with its 95% Wilson interval, episodes, resets per episode (and the fewest),
carried-state tokens per reset, tokens per episode (all windows), the whole conversation's tokens as
a multiple of the window, and compaction error (`strop.env.context.facts_lost`: the share of needed
keys, already shown by a tool, that a carried state no longer holds).

The policy is the chain demonstrator (`strop.env.chain_oracle`), a scripted agent that knows only
what its window shows; "learned" is the "summarize" strategy with the demonstrator writing its own
summaries — the prompted summary SFT would teach, before any RL. No model is trained or sampled
here: the numbers show what each strategy carries for an agent that needs it, not what RL learns.
"""

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

STRATEGIES = {"learned": "summarize", "truncation": "truncation", "masking": "masking", "compaction": "compaction"}
MAX_TURN_TOKENS = 320  # the demonstrator's longest turn, write_file with 32 keys, is ~280 tokens
SUMMARY_TOKENS = 320  # a 32-stage summary is ~280 tokens with the default tokenizer
MAX_RESETS = 32


def max_turns(stages: int) -> int:
    """Turns an episode may take: a chain needs one read per stage, a write and a submit; twice that
    lets an agent that lost keys read the whole chain again once."""
    return 2 * (stages + 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="16 episodes per strategy instead of 200")
    parser.add_argument("--episodes", type=int, help="held-out episodes per strategy (default 200, 16 with --quick)")
    parser.add_argument("--difficulty", type=int, default=3, help="chain difficulty (1: 4 stages, 2: 12, 3: 32)")
    parser.add_argument("--window", type=int, default=2048, help="context window in tokens")
    parser.add_argument("--workers", type=int, default=2, help="episodes run at once")
    parser.add_argument(
        "--tokenizer", help="tokenizer directory (default: the configured vocabulary, trained on 2 MB of the corpus)"
    )
    parser.add_argument("--json", help="write results to this JSON file")


def measure(tasks: list, tokenizer, strategy: str, window: int, workers: int) -> dict:
    """One strategy's figures over `tasks` (see the module docstring)."""
    from strop.env.chain_oracle import ChainDemonstrator
    from strop.env.checker import check, source_changes
    from strop.env.context import facts_lost
    from strop.env.harness import Harness, HarnessConfig, run_task
    from strop.rl.evaluate import wilson

    stages = len(tasks[0].metadata["facts"])
    harness = Harness(
        tokenizer,
        HarnessConfig(
            max_context=window,
            max_turn_tokens=MAX_TURN_TOKENS,
            max_turns=max_turns(stages),
            context_strategy=strategy,
            max_resets=MAX_RESETS,
            summary_tokens=SUMMARY_TOKENS,
        ),
    )

    def one(task) -> dict:
        episode, changes = run_task(harness, ChainDemonstrator(task, tokenizer), task)
        changes = source_changes(changes)
        reward = check(task, changes, perturbed=False).reward if changes else 0.0
        lost, found = facts_lost(episode.resets, episode.tool_calls, task.metadata["facts"])
        return {
            "solved": reward >= 1.0,
            "stop_reason": episode.stop_reason,
            "resets": len(episode.resets),
            "carried": [r["carried_tokens"] for r in episode.resets],
            "lost": lost,
            "found": found,
            "tokens": sum(len(s) for s in episode.segments),
            "conversation": harness.count(episode.messages),
        }

    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(one, tasks))
    n = len(results)
    solved = sum(r["solved"] for r in results)
    lo, hi = wilson(solved, n)
    carried = [c for r in results for c in r["carried"]]
    found = sum(r["found"] for r in results)
    stops: dict[str, int] = {}
    for r in results:
        stops[r["stop_reason"]] = stops.get(r["stop_reason"], 0) + 1
    return {
        "solve_rate": solved / n,
        "solve_rate_ci95": [round(lo, 4), round(hi, 4)],
        "eval_episodes": n,
        "carried_tokens_mean": sum(carried) / len(carried) if carried else 0.0,
        "resets_mean": sum(r["resets"] for r in results) / n,
        "resets_min": min(r["resets"] for r in results),
        "compaction_error": sum(r["lost"] for r in results) / found if found else 0.0,
        "tokens_per_episode": sum(r["tokens"] for r in results) / n,
        "window_multiple": sum(r["conversation"] for r in results) / n / window,
        "stop_reasons": stops,
    }


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(1)
    from strop.bench.table import format_table, write_json
    from strop.data.tokenizer import load_tokenizer
    from strop.env.oracle import default_tokenizer
    from strop.env.suites import load_suite
    from strop.errors import UserError

    episodes = args.episodes if args.episodes is not None else 16 if args.quick else 200
    if episodes < 1 or args.workers < 1:
        raise UserError(f"--episodes and --workers must be >= 1, got {episodes} and {args.workers}")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else default_tokenizer()
    tasks = load_suite("chain", "eval", difficulty=args.difficulty, limit=episodes)
    rows, out = [], {}
    for name, strategy in STRATEGIES.items():
        start = time.perf_counter()
        out[name] = measure(tasks, tokenizer, strategy, args.window, args.workers)
        rows.append(
            {
                "strategy": name,
                **{k: v for k, v in out[name].items() if k != "stop_reasons"},
                "seconds": time.perf_counter() - start,
            }
        )
        print(f"{name}: solved {out[name]['solve_rate']:.1%} of {len(tasks)} ({rows[-1]['seconds']:.0f} s)", flush=True)
    print(
        f"context strategies on chain/eval difficulty {args.difficulty} ({len(tasks)} episodes each), window "
        f"{args.window} tokens; policy: the chain demonstrator (scripted, no RL; 'learned' = its own summaries)"
    )
    print(
        format_table(
            rows,
            [
                "strategy",
                "solve_rate",
                "solve_rate_ci95",
                "eval_episodes",
                "resets_mean",
                "resets_min",
                "carried_tokens_mean",
                "compaction_error",
                "tokens_per_episode",
                "window_multiple",
            ],
        )
    )
    write_json(
        args.json,
        {
            "suite": "chain",
            "split": "eval",
            "difficulty": args.difficulty,
            "window": args.window,
            "policy": "chain demonstrator (scripted); learned = summarize with its own summaries, before RL",
            "strategies": out,
        },
    )
    return 0
