"""`strop bench oracle`: the scripted oracle through the real harness, tools, sandbox and reward
checker on a suite split. Reports the solve rate (overall and per difficulty), oracle episodes/s
(sandbox start, every tool call, diff and close; checking excluded) and the mean and longest
context window in tokens (the demonstrations must fit the policy's window: with `--config`, the
harness, chat template and window `strop sft` gives its demonstrations).

`--opening both` runs each task twice, side by side: with the demonstrator that follows the
failing tests' traceback (`strop.env.demonstrators.trace`, "trace") and with the old opening that
greps for the buggy function's name from the task's metadata ("guess"), for a task file
synthesized from a repository; "blind" counts the traced demonstrations that fell back to that
guess."""

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default="synthetic", help="task suite")
    parser.add_argument("--split", default="eval", choices=["train", "eval"], help="suite split")
    parser.add_argument("--limit", type=int, help="tasks per difficulty (synthetic) or in all (other suites)")
    parser.add_argument(
        "--tokenizer", help="tokenizer directory (default: the configured vocabulary, trained on 2 MB of the corpus)"
    )
    parser.add_argument(
        "--opening",
        default="trace",
        choices=["trace", "guess", "both"],
        help="a task with its failing tests in its repository: trace = follow their traceback, guess = grep the "
        "buggy function's name from the task's metadata (the old opening), both = each, side by side",
    )
    parser.add_argument("--config", help="run config whose demonstration harness to use (`strop sft`'s)")
    parser.add_argument("--json", help="write results to this JSON file")


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(1)
    from strop.bench.table import format_table, write_json
    from strop.data.tokenizer import load_tokenizer
    from strop.env.demonstrators.runs import DEMONSTRATION_HARNESS, default_tokenizer, solve
    from strop.env.tasks.suites import load_suite

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else default_tokenizer()
    opts = {"limit": args.limit} if args.suite == "synthetic" and args.limit else {}
    tasks = load_suite(args.suite, args.split, **opts)
    if args.suite != "synthetic" and args.limit:
        tasks = tasks[: args.limit]
    start = time.perf_counter()

    def progress(done: int, report: dict) -> None:
        if done % 25 == 0 or done == len(tasks):
            eta = (time.perf_counter() - start) / done * (len(tasks) - done)
            print(
                f"[{done}/{len(tasks)}] solved {report['solved']} ({report['solved'] / done:.1%}), eta {eta:.0f} s",
                flush=True,
            )

    config = DEMONSTRATION_HARNESS
    if args.config:
        from strop.config import load_config
        from strop.train.sft_data import demonstration_harness

        config = demonstration_harness(load_config(args.config))
    rows, failures = [], []
    openings = ["trace", "guess"] if args.opening == "both" else [args.opening]
    for opening in openings:
        report = solve(tasks, tokenizer, config, progress=progress, trace=opening == "trace")
        rows += opening_rows(opening, report)
        failures += [f"{opening} {r['id']}: {r['reason']}" for r in report["results"] if r["reward"] != 1.0]
    print(
        f"oracle on {args.suite}/{args.split} through the real harness and checker, "
        f"a {config.max_context}-token window ({time.perf_counter() - start:.0f} s)"
    )
    columns = ["opening", "difficulty", "tasks", "solved", "rate", "blind", "fits", "mean_tokens", "max_tokens"]
    print(format_table(rows, columns + ["episode_s"]))
    for line in failures[:20]:
        print("  failed", line)
    write_json(
        args.json,
        {
            "suite": args.suite,
            "split": args.split,
            "max_context": config.max_context,
            "tasks": len(tasks),
            "rows": rows,
            "failures": failures,
        },
    )
    return 0


def opening_rows(opening: str, report: dict) -> list[dict]:
    """One row per difficulty and one for all of `solve`'s `report`: solved, blind (fell back to
    the guess), fits (ended other than with a full window), tokens (the longest window of each)."""
    groups = {
        d: [r for r in report["results"] if r["difficulty"] == d] for d in {r["difficulty"] for r in report["results"]}
    }
    rows = []
    for d, mine in sorted(groups.items(), key=lambda kv: str(kv[0])) + [("all", report["results"])]:
        n = max(len(mine), 1)
        rows.append(
            {
                "opening": opening,
                "difficulty": d,
                "tasks": len(mine),
                "solved": sum(r["reward"] == 1.0 for r in mine),
                "rate": sum(r["reward"] == 1.0 for r in mine) / n,
                "blind": sum(r["blind"] for r in mine),
                "fits": sum(r["stop_reason"] != "context_full" for r in mine) / n,
                "mean_tokens": sum(r["tokens"] for r in mine) / n,
                "max_tokens": max((r["tokens"] for r in mine), default=0),
                "episode_s": sum(r["episode_s"] for r in mine) / n,
            }
        )
    return rows
