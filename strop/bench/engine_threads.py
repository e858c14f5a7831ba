"""`strop bench engine-threads [--checkpoint DIR] [--json F]`: an engine's decode step beside busy
Python threads, as in an RL run, where 8 rollout workers (sandbox I/O, tokenizing, the checker) and
a second engine share the process: milliseconds per decode step at batch 4 alone and beside 8
threads that run Python a given share of every 2 ms, and the torch calls a step makes (counted by
the profiler: each one releases the GIL and must win it back from those threads).

Default model: the random demo-size qwen3_moe of `strop bench engine`.
"""

import argparse
import time
from collections import Counter

BATCH, NEW_TOKENS, WORKERS = 4, 200, 8
BUSY = (0.0, 0.1, 0.3)  # the share of each 2 ms a worker spends running Python


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="model directory; default: a random demo-size qwen3_moe")
    parser.add_argument("--json", help="write results to this JSON file")


def run(args: argparse.Namespace) -> int:
    from strop.threads import hand_over_gil_quickly, set_threads

    set_threads(1)
    hand_over_gil_quickly()  # as an RL run sets it
    import torch
    from torch.profiler import profile

    from strop.bench.busy_threads import busy_threads
    from strop.bench.engine_inputs import prompts_from, setup
    from strop.bench.table import format_table, write_json
    from strop.cpu import describe, describe_line
    from strop.engine.engine import Engine
    from strop.policy_api import SamplingParams

    torch.manual_seed(0)
    model, tok, stream = setup(args.checkpoint)
    engine = Engine(model, tok, max_batch=BATCH, max_len=32 + NEW_TOKENS + 8, reuse_min=0, seed=0)
    prompts = prompts_from(stream, BATCH, 32, 0)

    def params(n: int) -> list[SamplingParams]:  # per-request seeds at T = 1, as rollouts sample
        return [SamplingParams(max_tokens=n, temperature=1.0, seed=i, stop_token_ids=[]) for i in range(BATCH)]

    engine.generate(prompts, params(4))  # warm-up

    def decode() -> None:
        engine.generate(prompts, params(NEW_TOKENS))

    rows = []
    for busy in BUSY:
        workers = WORKERS if busy else 0
        with busy_threads(workers, duty=busy):
            t0 = time.perf_counter()
            decode()
            ms = (time.perf_counter() - t0) / NEW_TOKENS * 1e3
        rows.append({"workers": workers, "busy": busy, "ms_per_step": ms})
    for row in rows:
        row["vs_alone"] = row["ms_per_step"] / rows[0]["ms_per_step"]
    steps = 20
    with profile() as prof:
        engine.generate(prompts, params(steps))
    calls = Counter(e.name for e in prof.events() if e.cpu_parent is None)  # top-level: one per Python call
    per_step = sum(calls.values()) / steps
    cpu = describe()
    print(f"an engine's decode step at batch {BATCH} beside busy Python threads; cpu: {describe_line(cpu)}")
    print(format_table(rows, list(rows[0])))
    print(f"torch calls per decode step: {per_step:.1f}; most frequent: {calls.most_common(6)}")
    write_json(args.json, {"rows": rows, "torch_calls_per_step": per_step, "calls": dict(calls), "cpu": cpu})
    return 0
