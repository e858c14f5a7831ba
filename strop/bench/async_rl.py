"""`strop bench async [--quick] --json F`: what asynchrony buys. The same RL configuration runs in
`sync` mode (generate, train, sync, repeat) and in `async` mode (rollouts on the newest weights
while the trainer consumes groups as they complete) on the same machine with the same
disaggregated placement: the trainer in its own process pinned to the first core, the engine and
rollout threads (and their sandboxes) to the rest — at scale the trainer cluster and the inference
clusters are disjoint too.

The two modes run as interleaved pairs (`--repeats`, default 3): a shared VM's speed drifts within
minutes, and the two runs of a pair see nearly the same machine. `speedup` is the median of the
pairs' ratios (`speedups` lists them). Each mode reports, pooled over its repeats, steps/hour (the
orchestrator's loop wall time; model loading excluded), trainer and engine busy fractions (seconds
spent stepping / loop wall time) and samples dropped for staleness, and the held-out solve rate of
its last run's final policy with a 95% interval. JSON: `speedup`, `speedups` and objects `sync` and
`async` with `steps_per_hour`, `trainer_busy`, `engine_busy`, `dropped`, `solve_rate` (+
`solve_rate_ci95`, `eval_episodes`, `steps`, `wall_s`).

Asynchrony can hide at most the shorter of the two phases, so its gain depends on their balance:
(g + t) / max(g, t) for generation time g and training time t per step, before the two sides
slow each other through the shared cache and memory. The default policy is a small MoE built
here (cached in the output directory) whose rollouts and training take about equally long on one
core each, as one would size an inference fleet to its trainer; `--policy DIR` measures another
(the demo's SFT model is trainer-bound on this placement: generation takes well under half as
long as training). Both modes train on the same tokens (`trained_tokens` in the JSON).
"""

import argparse
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

# The default policy is untrained, so every reward is 0 and every advantage too: the trainer would
# only run forward passes. skip_zero_advantage=false makes it train every sample, as it does the
# samples of a policy that gets rewards, so the bench measures the full cost of a training step.
BENCH = [
    "rl.group_size=4",
    "rl.batch_groups=2",
    "rl.max_staleness=2",
    "rl.skip_zero_advantage=false",
    "rollout.workers=8",
    "rollout.engine_batch=16",
    "rollout.max_turns=2",
    "rollout.max_turn_tokens=48",
    "rollout.max_context=1536",
    "rollout.ckpt_every=1000",
    "rollout.eval_difficulties=[1]",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from strop.config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="a few steps and a small eval (under a minute)")
    parser.add_argument("--steps", type=int, help="optimizer steps per mode and repeat (default 40, quick 10)")
    parser.add_argument(
        "--repeats", type=int, help="interleaved sync/async pairs; the speedup is their median (default 3, quick 1)"
    )
    parser.add_argument("--eval-episodes", type=int, help="held-out episodes per mode (default 100, quick 2)")
    parser.add_argument("--policy", help="model directory to train (default: a small MoE sized so both phases balance)")
    parser.add_argument("--out", default="runs/bench-async", help="working directory")
    parser.add_argument("--json", help="write results to this JSON file")


def tiny_policy(out: Path) -> Path:
    """A small random Qwen3-MoE with the small corpus tokenizer, built once: sized so that a step's
    rollouts on one core take about as long as its training on another."""
    from strop.config import ModelSection
    from strop.env.demonstrators.runs import default_tokenizer
    from strop.model.policy import build_model, is_model_dir, save_model

    # Width 64: once the engine reused prefixes across turns, width 96 made training ~1.8x as long
    # as rollouts on this placement (sync busy 0.60 vs 0.33), capping asynchrony near 1.55x.
    path = out / "policy-h64"
    if not is_model_dir(path):
        tok = default_tokenizer()
        section = ModelSection(
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            head_dim=32,
            num_experts=8,
            experts_per_token=2,
            expert_size=32,
            dense_size=128,
            max_positions=2048,
        )
        save_model(build_model(section, tok, seed=0), tok, path)
    return path


def train_once(cfg, mode: str, policy: Path, out: Path, cpus) -> dict:
    """One RL run in `mode` from `policy`; its loop figures (model loading excluded)."""
    from strop.outputs import remove_output
    from strop.report import MetricsLog
    from strop.runtime.rl_run import train_rl

    remove_output(out / mode, "train")  # the previous repeat's run
    r = train_rl(cfg, mode=mode, policy_dir=policy, out_dir=out / mode, cpus=cpus, trainer_process=True, quiet=True)
    rows = MetricsLog(out / mode / "metrics.jsonl").read()
    return {
        "steps": r["steps"],
        "trained_tokens": sum(row["tokens"] for row in rows),
        "wall_s": r["wall_s"],
        "trainer_s": r["trainer_s"],
        "engine_s": r["engine_busy_s"],
        "dropped": r["buffer"]["dropped"].get("stale", 0),
    }


def pooled(runs: list[dict]) -> dict:
    """A mode's figures over its repeats: totals, and fractions of the total wall time."""
    wall = sum(r["wall_s"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    return {
        "steps": steps,
        "trained_tokens": sum(r["trained_tokens"] for r in runs),
        "wall_s": round(wall, 1),
        "steps_per_hour": round(steps * 3600 / wall, 1),
        "trainer_busy": round(sum(r["trainer_s"] for r in runs) / wall, 3),
        "engine_busy": round(sum(r["engine_s"] for r in runs) / wall, 3),
        "dropped": sum(r["dropped"] for r in runs),
    }


def run(args: argparse.Namespace) -> int:
    from strop.threads import set_threads

    set_threads(1)  # one core per role: the placement, not torch's pool, decides who runs where
    from strop.bench.table import format_table, write_json
    from strop.config import load_config
    from strop.errors import UserError
    from strop.outputs import claim_dir, remove_output

    def given(value: int | None, quick: int, full: int) -> int:
        return (quick if args.quick else full) if value is None else value

    steps, repeats = given(args.steps, 10, 40), given(args.repeats, 1, 3)
    episodes = given(args.eval_episodes, 2, 100)
    if min(steps, repeats, episodes) < 1:
        raise UserError("bench async: --steps, --repeats and --eval-episodes must be at least 1")
    cfg = load_config(args.config, BENCH + [f"rl.steps={steps}", f"rollout.eval_episodes={episodes}"] + args.overrides)
    out = claim_dir(Path(args.out), "bench async")  # it deletes and rewrites its runs in there
    # the heavy imports only now: a refused --out answers at once, before seconds of torch and Ray
    from strop.rl.evaluate import eval_tasks, evaluate
    from strop.runtime.cpus import split_cores
    from strop.runtime.rl_run import train_rl

    t0 = time.perf_counter()
    policy = Path(args.policy) if args.policy else tiny_policy(out)
    tasks = eval_tasks(cfg)
    cpus = split_cores()
    # Warm-up, discarded: the first run of a process pays one-off costs (the sandbox host setup,
    # the sandbox interpreter's bytecode caches, the C kernels) that would otherwise count for sync.
    train_rl(
        replace(cfg, rl=replace(cfg.rl, steps=2)),
        mode="sync",
        policy_dir=policy,
        out_dir=out / "warm-up",
        cpus=cpus,
        trainer_process=True,
        quiet=True,
    )
    remove_output(out / "warm-up", "train")
    # Interleaved pairs: a shared VM's speed drifts by tens of percent within minutes, and a pair
    # run back to back sees nearly the same machine; the median pair is robust to one bad stretch.
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    ratios = []
    for i in range(repeats):
        for mode in ("sync", "async"):
            runs[mode].append(train_once(cfg, mode, policy, out, cpus))
        sync, async_ = runs["sync"][-1], runs["async"][-1]
        ratios.append(sync["wall_s"] / async_["wall_s"])  # same step count: the steps/hour ratio
        print(
            f"[bench async] pair {i + 1}/{repeats}: sync {sync['wall_s']:.1f} s, async {async_['wall_s']:.1f} s, "
            f"{ratios[-1]:.2f}x",
            flush=True,
        )
    speedup = statistics.median(ratios)
    results = {}
    for mode in ("sync", "async"):
        held_out = evaluate(cfg, str(out / mode / "model"), tasks)  # the last repeat's final policy
        results[mode] = {
            **pooled(runs[mode]),
            "solve_rate": held_out["solve_rate"],
            "solve_rate_ci95": held_out["solve_rate_ci95"],
            "eval_episodes": held_out["eval_episodes"],
        }
    rows = [{"mode": m, **{k: v for k, v in r.items() if k != "solve_rate_ci95"}} for m, r in results.items()]
    print(
        f"sync vs async RL, {repeats} x {steps} steps each, policy {policy}, placement {cpus} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    print(
        format_table(
            rows,
            [
                "mode",
                "steps",
                "wall_s",
                "steps_per_hour",
                "trainer_busy",
                "engine_busy",
                "dropped",
                "solve_rate",
                "eval_episodes",
            ],
        )
    )
    print(
        f"speedup (async / sync steps per hour, median of {repeats} interleaved pairs): {speedup:.2f}x "
        f"(pairs: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    write_json(
        args.json,
        {
            "speedup": round(speedup, 3),
            "speedups": [round(r, 3) for r in ratios],
            **results,
            "policy": str(policy),
            "steps": steps,
            "repeats": repeats,
            "group_size": cfg.rl.group_size,
            "batch_groups": cfg.rl.batch_groups,
            "max_staleness": cfg.rl.max_staleness,
            "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        },
    )  # a shared machine's load skews every figure
    return 0
