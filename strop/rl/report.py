"""The RL run report: `report.md` with PNG plots, made from an RL run's `metrics.jsonl` and the
held-out evaluations before and after RL — what a person looks at to see whether a run learned.

Plots: training reward and solve rate per step with their moving averages (and the held-out solve
rates with their 95% intervals), the training solve rate by task difficulty, what the policy did per
step and before vs after RL (behaviour), why a step moved the policy or did not (mixed groups,
update size, logprob movement, clipping), the staleness histogram over all trained samples, bytes
synced to the engines, engine/trainer mismatch, and trainer/engine busy fractions; and the steps'
time budget (`strop.rl.budget`).
"""

from collections import Counter
from pathlib import Path

from strop.env.grading.behaviour import LABELS
from strop.report import MetricsLog, plot_metrics
from strop.rl.budget import budget_lines, budget_table

SMOOTH = 5  # steps in the moving averages of per-step curves
# the `strop.env.grading.behaviour.summarize` keys the behaviour plot and table compare (the plot's per-step
# curves: the first four, which the orchestrator logs)
BEHAVIOUR = ["rejected_edit", "retry_after_rejected_edit", "test_runs", "submitted_untested", "submitted_failing_tests"]


def _line(
    rows: list[dict],
    keys: list[str],
    path: Path,
    title: str,
    ylabel: str = "",
    evals: dict[str, dict] | None = None,
    smooth: int = 0,
) -> str:
    last = max((r["step"] for r in rows), default=1)
    points = {}
    for (name, ev), at in zip((evals or {}).items(), (0, last)):
        points[f"held-out greedy, {name}"] = (at, ev["solve_rate"], *ev["solve_rate_ci95"])
        if sampled := ev.get("sampled"):
            points[f"held-out T = {sampled['temperature']:g}, {name}"] = (
                at,
                sampled["pass@1"],
                *sampled["pass@1_ci95"],
            )
    plot_metrics(rows, path, keys, title, ylabel=ylabel, points=points, smooth=smooth)
    return path.name


def _behaviour(rows: list[dict], evals: dict[str, dict], path: Path) -> str:
    """Left: tracked behaviour per RL step (moving averages); right: the held-out evaluations'
    behaviour side by side (greedy), when there are any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from strop.report import moving_average

    with_evals = [name for name, ev in evals.items() if ev.get("behaviour", {}).get("episodes")]
    fig, axes = plt.subplots(1, 2 if with_evals else 1, figsize=(11 if with_evals else 6, 3.8), squeeze=False)
    ax = axes[0][0]
    for key in BEHAVIOUR[:4]:
        pts = [(r["step"], r[f"behaviour_{key}"]) for r in rows if r.get(f"behaviour_{key}") is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, moving_average(list(ys), SMOOTH), label=LABELS[key], linewidth=2)
    ax.set_xlabel("step")
    ax.set_title(f"Training samples' behaviour (mean of {SMOOTH} steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if with_evals:
        ax = axes[0][1]
        width = 0.8 / len(with_evals)
        for i, name in enumerate(with_evals):
            b = evals[name]["behaviour"]
            ax.bar(
                [j + i * width for j in range(len(BEHAVIOUR))],
                [b.get(k) or 0 for k in BEHAVIOUR],
                width,
                label=f"held-out, {name}",
            )
        ax.set_xticks([j + width * (len(with_evals) - 1) / 2 for j in range(len(BEHAVIOUR))])
        ax.set_xticklabels([LABELS[k] for k in BEHAVIOUR], rotation=20, ha="right", fontsize=8)
        ax.set_title("Held-out behaviour (greedy)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _behaviour_table(evals: dict[str, dict]) -> list[str]:
    named = {k: v["behaviour"] for k, v in evals.items() if v.get("behaviour", {}).get("episodes")}
    if not named:
        return []

    def cell(v) -> str:
        return "" if v is None else f"{v:.2f}"

    lines = [
        "## Behaviour on held-out tasks (greedy)",
        "",
        "| | " + " | ".join(named) + " |",
        "|---|" + "---|" * len(named),
    ]
    for key in ["turns", *BEHAVIOUR]:
        lines.append(f"| {LABELS[key]} | " + " | ".join(cell(b.get(key)) for b in named.values()) + " |")
    return lines + [""]


def _staleness(rows: list[dict], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist: Counter = Counter()
    for r in rows:
        hist.update({int(k): v for k, v in r.get("staleness_hist", {}).items()})
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ks = sorted(hist) or [0]
    ax.bar(ks, [hist[k] for k in ks])
    ax.set_xticks(ks)
    ax.set_xlabel("staleness (versions behind the trainer, oldest token)")
    ax.set_ylabel("trained samples")
    ax.set_title("Staleness of trained samples")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _rate(rate: float, ci95: list[float]) -> str:
    return f"{rate:.3f} [{ci95[0]:.3f}, {ci95[1]:.3f}]"


def _eval_rows(name: str, ev: dict) -> list[str]:
    """The greedy evaluation's table row and, when the evaluation also sampled, the sampled one."""
    by_d = ", ".join(
        f"d{d}: {_rate(v['solve_rate'], v['solve_rate_ci95'])} (n={v['eval_episodes']})"
        for d, v in ev.get("by_difficulty", {}).items()
    )
    outcomes = ", ".join(f"{k} {n}" for k, n in ev.get("outcomes", {}).items())
    (lo, hi), n = ev["solve_rate_ci95"], ev["eval_episodes"]
    rows = [f"| {name}, greedy | {ev['solve_rate']:.3f} | [{lo:.3f}, {hi:.3f}] | {n} | {by_d} | {outcomes} |"]
    if s := ev.get("sampled"):
        by_d = ", ".join(
            f"d{d}: {_rate(v['pass@1'], v['pass@1_ci95'])} (n={v['tasks'] * s['samples']})"
            for d, v in s.get("by_difficulty", {}).items()
        )
        (lo, hi), n = s["pass@1_ci95"], s["tasks"] * s["samples"]
        rows.append(f"| {name}, T = {s['temperature']:g} | {s['pass@1']:.3f} | [{lo:.3f}, {hi:.3f}] | {n} | {by_d} | |")
    return rows


def solve_rate_gains(evals: dict[str, dict]) -> dict[str, float]:
    """RL's held-out gains (rl minus sft): greedy overall and per difficulty, and, where both
    evaluations sampled, at that temperature (keys `sampled`, `sampled_d<N>`)."""
    sft, rl = evals["sft"], evals["rl"]
    gain = {"all": rl["solve_rate"] - sft["solve_rate"]}
    for d, ev in rl.get("by_difficulty", {}).items():
        gain[f"d{d}"] = ev["solve_rate"] - sft["by_difficulty"][d]["solve_rate"]
    if "sampled" in sft and "sampled" in rl:
        gain["sampled"] = rl["sampled"]["pass@1"] - sft["sampled"]["pass@1"]
        for d, ev in rl["sampled"].get("by_difficulty", {}).items():
            gain[f"sampled_d{d}"] = ev["pass@1"] - sft["sampled"]["by_difficulty"][d]["pass@1"]
    return {k: round(v, 4) for k, v in gain.items()}


def _shown_path(path: Path) -> str:
    """Relative to the working directory when under it (`runs/demo`), else absolute."""
    import os

    rel = os.path.relpath(path)
    return str(path.resolve()) if rel.startswith("..") else rel


def _rollouts_section(out_dir: Path, rollouts: Path, rows: int = 20) -> list[str]:
    """A table of kept steps (up to `rows`, evenly spaced, first and last included): each step's best
    and worst trajectory, linked to its file, with the command that prints them."""
    import os

    from strop.rl.rollout_log import RolloutLog, best_and_worst, read

    steps = RolloutLog(rollouts, 1).steps()
    if not steps:
        return []
    ns = list(steps)
    count = min(rows, len(ns))
    shown = sorted({ns[round(i * (len(ns) - 1) / max(1, count - 1))] for i in range(count)})
    run = rollouts.parent.parent if rollouts.parent.name == "rl" else rollouts.parent
    lines = [
        "## Rollouts",
        "",
        f"{len(ns)} steps kept in `{_shown_path(rollouts)}`; each step's best and worst trajectory "
        f"(`strop runs show {_shown_path(run)} --step N` prints them in full).",
        "",
        "| step | best: task, reward | worst: task, reward | file |",
        "|---|---|---|---|",
    ]
    for n in shown:
        ends = best_and_worst(read(steps[n]))
        cells = [f"`{r['task_id']}` {r['reward']:.2f}" for r in ends] + [""] * (2 - len(ends))
        link = os.path.relpath(steps[n], out_dir)
        lines.append(f"| {n} | {cells[0]} | {cells[1]} | [{steps[n].name}]({link}) |")
    return lines + [""]


def write_report(out_dir: Path, metrics_path: Path, evals: dict[str, dict]) -> Path:
    """Write `out_dir/report.md` and its plots; `evals` maps a stage name ("sft", "rl") to its
    held-out evaluation (`strop.rl.evaluate.evaluate`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = MetricsLog(metrics_path).read()
    for r in rows:
        r["bytes_synced_mb"] = r.get("bytes_synced", 0) / 1e6
    plots = [
        (
            "Reward and solve rate",
            _line(
                rows,
                ["reward", "solve_rate"],
                out_dir / "reward.png",
                "Training reward and solve rate per step",
                evals=evals,
                smooth=SMOOTH,
            ),
        ),
        ("Behaviour", _behaviour(rows, evals, out_dir / "behaviour.png")),
        (
            "Why steps moved the policy",
            _line(
                rows,
                ["mixed_groups", "dlogp_pos", "dlogp_neg", "clip_frac"],
                out_dir / "learning.png",
                "Groups with mixed outcomes; logprob change "
                "of sampled tokens after each step (A>0, A<0); PPO-clipped tokens",
                smooth=SMOOTH,
            ),
        ),
        ("Staleness", _staleness(rows, out_dir / "staleness.png")),
        (
            "Weight sync",
            _line(
                rows, ["bytes_synced_mb"], out_dir / "bytes_synced.png", "Bytes synced to engines (cumulative)", "MB"
            ),
        ),
        (
            "Mismatch",
            _line(
                rows,
                ["k3", "mismatch_mean_abs_dlogp", "mismatch_ratio_outside_frac"],
                out_dir / "mismatch.png",
                "Engine vs trainer (incl. staleness drift)",
            ),
        ),
        (
            "Utilisation",
            _line(
                rows,
                ["trainer_busy", "engine_busy"],
                out_dir / "busy.png",
                "Busy fraction of trainer and engine",
                "fraction",
            ),
        ),
    ]
    levels = sorted({k for r in rows for k in r if k.startswith("solve_rate_d")})
    if levels:  # runs before the per-difficulty rates were logged have none
        title = "Training solve rate per step, by task difficulty (rl.curriculum: uniform or at the edge)"
        plots.insert(
            1, ("Solve rate by difficulty", _line(rows, levels, out_dir / "difficulty.png", title, smooth=SMOOTH))
        )
    last = rows[-1] if rows else {}
    kinds: Counter = Counter()
    for r in rows:
        kinds.update(r.get("hack_kinds", {}))
    flagged = ", ".join(f"{k} {n}" for k, n in kinds.most_common())
    if flagged:  # `degenerate` flags failures (invalid-call loops, stalling, asking), not hacks
        flagged = f" (flags by kind: {flagged})"
    lines = ["# strop run report", ""]
    if evals:
        lines += [
            "## Held-out evaluation",
            "",
            "| policy | solve rate | 95% interval | episodes | by difficulty | outcomes |",
            "|---|---|---|---|---|---|",
            *[row for k, v in evals.items() for row in _eval_rows(k, v)],
            "",
        ]
        if {"sft", "rl"} <= evals.keys():
            gain = solve_rate_gains(evals)
            said = f"RL changed the held-out solve rate by **{gain['all'] * 100:+.1f} points** greedy"
            if "sampled" in gain:
                said += f" and by **{gain['sampled'] * 100:+.1f} points** sampled at the training temperature"
            lines += [said + ".", ""]
        lines += _behaviour_table(evals)
    if last:
        lines += [
            "## Training",
            "",
            f"{last['step']} steps ({last.get('mode', '')}), {last.get('wall_s', 0):.0f} s; "
            f"dropped for staleness: {last.get('dropped_stale', 0)}; samples the hack monitor flagged: "
            f"{last.get('hacked_total', 0)}{flagged}; trainer busy {last.get('trainer_busy', 0):.2f}, "
            f"engine busy {last.get('engine_busy', 0):.2f}; bytes synced {last.get('bytes_synced', 0) / 1e6:.1f} MB.",
            "",
        ]
        if budget := budget_lines(budget_table(rows)):
            lines += ["### Where a step's time goes", "", *budget]
    for title, name in plots:
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    lines += _rollouts_section(out_dir, metrics_path.parent / "rollouts")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
