"""The long-horizon report: `strop bench longctx` results as markdown, before and after RL.

`render` takes two runs of `strop bench longctx --policy` (plain JSON: the warm start's and the RL
policy's, on the same held-out chains) and writes each strategy's figures side by side, then, for
the first few held-out chains (in task order, not chosen by outcome), the summaries each policy wrote
at every reset next to each other. A key in a summary that is not one of the chain's keys is struck
through, and each summary says how many of the keys found so far it carries, so a reader sees where
a carried state lost a fact.
"""

import re

from strop.rl.evaluate import paired_change

KEY = re.compile(r"\b\d{4}-\d{4}\b")


def _rate(f: dict) -> str:
    lo, hi = f["solve_rate_ci95"]
    return f"{f['solve_rate']:.1%} [{lo:.1%}, {hi:.1%}] of {f['eval_episodes']}"


def _after_resets(show):
    """A figure of carried states: a dash for a run without a reset."""
    return lambda f: show(f) if f.get("resets_mean") else "— (no reset)"


def _error(f: dict) -> str:
    e = f["compaction_error"]
    return "— (no fact shown)" if e is None else f"{e:.3f} of {f['facts_found']:,}"


def _reward(f: dict) -> str:
    """Mean checker reward with its interval; a dash for a JSON written before the bench kept it."""
    if "reward_mean" not in f:
        return "—"
    lo, hi = f["reward_ci95"]
    return f"{f['reward_mean']:.3f} [{lo:.3f}, {hi:.3f}]"


# (label, the figure's cell for one strategy's results)
FIGURES = [
    ("solved [95% interval]", _rate),
    ("mean reward: share of checks passed [95% interval]", _reward),
    ("resets / episode (fewest)", lambda f: f"{f['resets_mean']:.2f} ({f['resets_min']})"),
    ("carried tokens / reset", _after_resets(lambda f: f"{f['carried_tokens_mean']:,.0f}")),
    ("compaction error", _after_resets(_error)),
    ("tokens / episode", _after_resets(lambda f: f"{f['tokens_per_episode']:,.0f}")),
]


def _cell(f: dict | None, show) -> str:
    return "not run" if f is None else show(f)


def strategy_table(before: dict, after: dict) -> str:
    """Every strategy's figures, before and after RL, as one markdown table."""
    names = list(dict.fromkeys([*after["strategies"], *before["strategies"]]))
    head = "| strategy | figure | before RL | after RL |\n|---|---|---|---|"
    rows = [
        f"| {name} | {label} | {_cell(before['strategies'].get(name), show)} | "
        f"{_cell(after['strategies'].get(name), show)} |"
        for name in names
        for label, show in FIGURES
    ]
    return "\n".join([head, *rows])


def paired_line(before: dict, after: dict) -> str:
    """The learned strategy's solve outcomes, paired chain by chain (`paired_change`)."""
    b, a = ({t: e["solved"] for t, e in r["strategies"]["learned"]["episodes"].items()} for r in (before, after))
    c = paired_change(b, a)
    return (
        f"Learned, chain by chain on the {c['tasks']} held-out chains both runs played: {c['gained']} solved "
        f"only after RL, {c['lost']} only before (exact McNemar p = {c['mcnemar_p']:.3g})."
    )


def _mark(summary: str, facts: list[str], found: int) -> str:
    """A summary as one table cell: wrong keys struck through, and how many of the `found` keys
    (the chain's first `found`: stages are read in order, and its tool outputs had shown that many)
    it carries."""
    kept = sum(f in summary for f in facts[:found])
    text = KEY.sub(lambda m: m.group(0) if m.group(0) in facts else f"~~{m.group(0)}~~", summary)
    text = text.replace("|", "\\|").replace("\n", "<br>")
    return f"{kept}/{found} keys: {text}"


def side_by_side(before: dict, after: dict, examples: int) -> str:
    """The learned strategy's summaries before and after RL for the first `examples` chains both
    runs played, reset by reset."""
    facts = after["facts"]
    b, a = before["strategies"]["learned"]["episodes"], after["strategies"]["learned"]["episodes"]
    out = []
    for task_id in [t for t in facts if t in b and t in a][:examples]:
        keys = facts[task_id]
        outcome = [
            f"{'solved' if r[task_id]['solved'] else 'not solved'} ({r[task_id]['stop_reason']})" for r in (b, a)
        ]
        out.append(f"### {task_id}\n\nKeys: `{' '.join(keys)}`. Before RL: {outcome[0]}; after RL: {outcome[1]}.\n")
        out.append("| reset | before RL | after RL |\n|---|---|---|")
        runs = (b[task_id], a[task_id])
        for i in range(max(len(r["summaries"]) for r in runs)):
            cells = [
                _mark(r["summaries"][i], keys, r["facts_shown"][i]) if i < len(r["summaries"]) else "(no reset)"
                for r in runs
            ]
            out.append(f"| {i + 1} | {cells[0]} | {cells[1]} |")
        out.append("")
    return "\n".join(out)


def render(before: dict, after: dict, examples: int = 3) -> str:
    """The whole report (markdown)."""
    return "\n".join(
        [
            "# Long horizon: learned summaries before and after RL",
            "",
            f"Held-out `chain` tasks of difficulty {after['difficulty']} in a {after['window']}-token window "
            f"(`strop bench longctx`). Before RL: `{before['policy']}`; after RL: `{after['policy']}`.",
            "",
            strategy_table(before, after),
            "",
            paired_line(before, after),
            "",
            f"## Summaries side by side (the first {examples} held-out chains)",
            "",
            "Each cell: how many of the keys found so far the summary carries, then the summary; a key "
            "that is not the chain's is struck through.",
            "",
            side_by_side(before, after, examples),
        ]
    )
