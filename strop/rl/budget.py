"""An RL step's time budget: where the seconds of a step go, on the engine side and the trainer
side, so the critical path is visible.

The orchestrator logs, per step (`step_budget`, keys prefixed `time_`): how long its loop waited
for the step's groups (`wait_s`: generation had not delivered them yet) and how long the trainer
call took (`train_s`); the trainer's own split (`forward_s` with the loss, `backward_s`,
`optimizer_s`, `measure_s`, `publish_s`, from `strop.rl.trainer`); the rollout workers' seconds
summed over the step's episodes (`episode_budget`: the policy's calls, of which the engine's queue,
prefill and decode; tool calls; the harness's own Python; the episode's sandbox start and close;
the checker; the hack monitor); the engines' seconds over the step's wall time (prefill,
decode, the rest of their steps, weight swaps, idle); and the machine's CPU seconds over the step
(`cpu_budget`: the trainer's process, the loop's process with the engines and rollout threads, every
other process, which is the sandboxes with their tools and tests and the checks, and what went
unused). Wall seconds overlap on a machine whose cores every side shares; CPU seconds say which side
holds the cores.

Async RL overlaps the two sides: a step takes max(generation, training) plus what they cost each
other, so `wait_s` > 0 means generation is on the critical path and `wait_s` near 0 means the
trainer is. `budget_table` averages the rows into the table the report and `strop bench budget`
print.
"""

from collections.abc import Iterable

from strop.run_files import METRICS

# per-episode seconds the rollout records (`Trajectory.timings`), in the order of an episode
EPISODE = ("sandbox_s", "policy_s", "tools_s", "harness_s", "check_s", "monitor_s")
ENGINE = ("prefill_s", "decode_s", "queued_s", "swap_s")
TOKENS = ("prefilled_tokens", "prefix_reused_tokens", "decoded_tokens")
TRAINER = ("forward_s", "backward_s", "optimizer_s", "measure_s", "publish_s")
CPU = ("trainer", "loop", "other", "unused")  # who used the machine's CPU seconds (`cpu_budget`)

# (side, key) of the table's rows, in order; what each is: `strop.run_files.METRICS`
ROWS = [
    ("step", "time_step_s"),
    ("step", "time_wait_s"),
    ("step", "time_train_s"),
    *[("trainer", k) for k in TRAINER],
    *[("engines", f"time_engine_{k}") for k in ("prefill_s", "decode_s", "other_s", "swap_s", "idle_s")],
    *[("rollouts", f"time_episode_{k}") for k in EPISODE[:2]],
    ("rollouts", "time_engine_queued_s"),  # part of the policy's seconds
    *[("rollouts", f"time_episode_{k}") for k in EPISODE[2:]],
    *[("cpu", f"time_cpu_{k}_s") for k in CPU],
]


def episode_budget(timings: Iterable[dict]) -> dict[str, float]:
    """Per-episode seconds (`Trajectory.timings`) summed over episodes, as `time_episode_<part>`;
    the harness's own Python is what its total leaves after the policy and the tools."""
    out = {f"time_episode_{k}": 0.0 for k in EPISODE}
    n = 0
    for t in timings:
        n += 1
        for k in EPISODE:
            v = t.get("total_s", 0.0) - t.get("policy_s", 0.0) - t.get("tools_s", 0.0) if k == "harness_s" else t.get(k)
            out[f"time_episode_{k}"] += v or 0.0
    return {**out, "time_episodes": n}


def engine_budget(before: dict, after: dict, wall_s: float) -> dict[str, float]:
    """The engines' seconds and tokens between two `engine_stats()` readings `wall_s` apart, as
    `time_engine_<part>`: prefill, decode, swaps, the rest of their busy time, and idle."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("busy_s", *ENGINE, *TOKENS)}
    out = {f"time_engine_{k}": d[k] for k in (*ENGINE, *TOKENS)}
    out["time_engine_other_s"] = max(0.0, d["busy_s"] - d["prefill_s"] - d["decode_s"] - d["swap_s"])
    out["time_engine_idle_s"] = max(0.0, after.get("engines", 1) * wall_s - d["busy_s"])
    return out


def cpu_budget(before: dict, after: dict) -> dict[str, float]:
    """The machine's CPU seconds between two `cpu_seconds()` readings (`strop.runtime.cpus.cpu_reading`),
    as `time_cpu_<who>_s`: the trainer's process, the loop's, every other process (the sandboxes and
    checks, and any other job), and unused. {} where the runtime cannot tell."""
    if not before or not after:
        return {}
    d = {k: max(0.0, after[k] - before[k]) for k in ("trainer", "loop", "busy", "unused")}
    return {
        "time_cpu_trainer_s": d["trainer"],
        "time_cpu_loop_s": d["loop"],
        "time_cpu_other_s": max(0.0, d["busy"] - d["trainer"] - d["loop"]),
        "time_cpu_unused_s": d["unused"],
    }


def budget_table(rows: list[dict]) -> dict:
    """Mean seconds per step of every `ROWS` entry over `rows` (metrics rows that have them), the
    engines' tokens per step, and which side is on the critical path."""
    timed = [r for r in rows if "time_step_s" in r]
    if not timed:
        return {}

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in timed) / len(timed)

    what = METRICS["rl"]
    table = [
        {"side": side, "part": key, "what": what[key], "s_per_step": round(mean(key), 3)}
        for side, key in ROWS
        if side != "cpu" or key in timed[0]
    ]
    wait, train = mean("time_wait_s"), mean("time_train_s")
    return {
        "steps": len(timed),
        "rows": table,
        "episodes_per_step": round(mean("time_episodes"), 2),
        "cpu_s_per_step": round(sum(mean(f"time_cpu_{k}_s") for k in CPU), 3),
        "tokens_per_step": {k: round(mean(f"time_engine_{k}"), 1) for k in TOKENS},
        "critical_path": "generation" if wait > train else "trainer",
    }


def budget_lines(budget: dict) -> list[str]:
    """`budget_table`'s result as Markdown: a table and one line on the critical path."""
    if not budget:
        return []
    step = next(r["s_per_step"] for r in budget["rows"] if r["part"] == "time_step_s")
    lines = ["| side | part | s per step | share of the step | what |", "|---|---|---|---|---|"]
    for r in budget["rows"]:
        whole = budget.get("cpu_s_per_step", 0) if r["side"] == "cpu" else step
        share = f"{r['s_per_step'] / whole:.0%}" if whole else ""
        lines.append(f"| {r['side']} | `{r['part']}` | {r['s_per_step']:.2f} | {share} | {r['what']} |")
    tok = budget["tokens_per_step"]
    lines += [
        "",
        f"Means over {budget['steps']} steps, {budget['episodes_per_step']:g} episodes a step. Engine and rollout "
        "rows are seconds summed over engines and over episodes (they overlap), so their share can pass 100%; "
        "a CPU row's share is of the machine's CPU seconds (every core's) over the step. "
        f"Tokens per step: {tok['prefilled_tokens']:.0f} prefilled, {tok['prefix_reused_tokens']:.0f} reused from "
        f"parked KV, {tok['decoded_tokens']:.0f} decoded. Critical path: **{budget['critical_path']}**.",
        "",
    ]
    return lines
