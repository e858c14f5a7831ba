"""`strop bench oracle`: the scripted oracle through the real harness, tools, sandbox and reward
checker on a suite split. Reports the solve rate (overall and per difficulty), oracle episodes/s
(sandbox start, every tool call, diff and close; checking excluded) and the longest context window
in tokens (the demonstrations must fit the policy's window)."""

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default="synthetic", help="task suite")
    parser.add_argument("--split", default="eval", choices=["train", "eval"], help="suite split")
    parser.add_argument("--limit", type=int, help="tasks per difficulty (synthetic) or in all (other suites)")
    parser.add_argument(
        "--tokenizer", help="tokenizer directory (default: the configured vocabulary, trained on 2 MB of the corpus)"
    )
    parser.add_argument("--json", help="write results to this JSON file")


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(1)
    from strop.bench.table import format_table, write_json
    from strop.data.tokenizer import load_tokenizer
    from strop.env.demonstrators.runs import default_tokenizer, solve
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

    report = solve(tasks, tokenizer, progress=progress)
    rows = []
    for d in sorted({r["difficulty"] for r in report["results"]}, key=str):
        mine = [r for r in report["results"] if r["difficulty"] == d]
        solved = sum(r["reward"] == 1.0 for r in mine)
        rows.append(
            {
                "difficulty": d,
                "tasks": len(mine),
                "solved": solved,
                "rate": solved / len(mine),
                "episode_s": sum(r["episode_s"] for r in mine) / len(mine),
                "max_tokens": max(r["tokens"] for r in mine),
            }
        )
    rows.append(
        {
            "difficulty": "all",
            "tasks": report["tasks"],
            "solved": report["solved"],
            "rate": report["rate"],
            "episode_s": 1 / report["episodes_per_s"] if report["episodes_per_s"] else None,
            "max_tokens": max((r["tokens"] for r in report["results"]), default=0),
        }
    )
    print(
        f"oracle on {args.suite}/{args.split} through the real harness and checker "
        f"({time.perf_counter() - start:.0f} s)"
    )
    print(format_table(rows, ["difficulty", "tasks", "solved", "rate", "episode_s", "max_tokens"]))
    failures = [f"{r['id']}: {r['reason']}" for r in report["results"] if r["reward"] != 1.0]
    for line in failures[:20]:
        print("  failed", line)
    write_json(
        args.json,
        {
            "suite": args.suite,
            "split": args.split,
            "tasks": report["tasks"],
            "solved": report["solved"],
            "solve_rate": report["rate"],
            "oracle_episodes_per_s": report["episodes_per_s"],
            "stop_reasons": report["stop_reasons"],
            "by_difficulty": rows[:-1],
            "failures": failures,
        },
    )
    return 0
