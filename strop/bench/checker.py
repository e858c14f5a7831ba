"""`strop bench checker [--tasks N] --json F`: what scoring an episode costs, on the demo's suite
(`synthetic/parse`, graded by values: `strop.env.grading.isolated`), in three modes side by side in
one run on the same change sets, and the verdicts of all compared: the judge's first round run for
every check (an empty memo keeping none) on a fresh copy of the task's repository per sandbox;
the first round remembered, still a fresh copy per sandbox (as before copies were shared:
`strop.env.world.shared_repos.KEPT = 0`, copies of their own); and the first round remembered on
the copy the task's sandboxes share.

Each held-out task of difficulties 1 and 2 is scored with four change sets: the reference fix (it
pays, so the perturbed tests run too: two gradings), an edit that changes nothing the checks see, a
module that exits on import, and an always-equal forgery (one grading each, failed). Every mode
scores every change set once per round, the order of the modes rotating; the remembering modes'
first round of a task was computed before, as in a run, where a task is graded again and again (a
group's samples, each policy's evaluations), and the shared copy made then too (in a run the
episode's sandbox made it). Wall-clock seconds per check, and this process's CPU seconds (the
checker's host side: sandboxes, files, waiting; the programs inside the sandboxes are not this
process's children and do not count).
"""

import argparse
import os
import resource
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", type=int, default=10, help="held-out tasks per difficulty (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="times each change set is scored per mode (default 2)")
    p.add_argument("--json", help="write results to this JSON file")


def _cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def _change_sets(task) -> dict[str, dict[str, str]]:
    edit = task.metadata["reference_edits"][0]
    source = task.files[edit["path"]]
    always = "\n\nclass Always:\n    def __eq__(self, other):\n        return True\n\n\n"
    forged = always + f"def {task.metadata['function']}(*a):\n    return Always()\n"
    return {
        "fix": {edit["path"]: source.replace(edit["old"], edit["new"])},
        "no-op": {edit["path"]: source + "\n# changes nothing the checks see\n"},
        "crash": {edit["path"]: source + "\nraise SystemExit(0)\n"},
        "always-equal": {edit["path"]: source + forged},
    }


MODES = {  # name: (first rounds remembered, the repository shared)
    "every round run": (False, False),
    "first round remembered": (True, False),
    "and the repository shared": (True, True),
}


def run(args: argparse.Namespace) -> int:
    from collections import OrderedDict
    from statistics import median

    from strop.bench.table import format_table, write_json
    from strop.env.grading import isolated
    from strop.env.grading.checker import check
    from strop.env.suites.synthetic import make_task, parse_themes
    from strop.env.world import shared_repos, task_world

    kept, remembered = isolated.FIRST_ROUNDS_KEPT, isolated._first_rounds
    copies_kept, shared = shared_repos.KEPT, task_world.SHARED
    tasks = [make_task(d, "eval", i, parse_themes("parse")) for d in (1, 2) for i in range(args.tasks)]
    cases = [(t, name, changes) for t in tasks for name, changes in _change_sets(t).items()]
    wall: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu = dict.fromkeys(wall, 0.0)
    verdicts: dict[str, list[dict]] = {k: [] for k in wall}
    load = os.getloadavg()[0]
    check(*cases[0][::2])  # warm: per-process setup (the image's module list, the sandbox account)
    for r in range(args.rounds):
        for i, (task, _, changes) in enumerate(cases):
            order = list(MODES)[(i + r) % len(MODES) :] + list(MODES)[: (i + r) % len(MODES)]
            for mode in order:
                first_rounds, sharing = MODES[mode]
                # an empty memo that keeps nothing; copies of a pool of its own that keeps none
                memo = (kept, remembered) if first_rounds else (0, OrderedDict())
                isolated.FIRST_ROUNDS_KEPT, isolated._first_rounds = memo
                fresh = shared_repos.SharedRepositories()
                shared_repos.KEPT, task_world.SHARED = (copies_kept, shared) if sharing else (0, fresh)
                if first_rounds and r == 0:
                    check(task, changes)  # the task graded before, as in a run
                c0, t0 = _cpu_s(), time.perf_counter()
                score = check(task, changes)
                wall[mode].append(time.perf_counter() - t0)
                cpu[mode] += _cpu_s() - c0
                verdicts[mode].append({k: v for k, v in score.to_dict().items() if k != "duration"})
    isolated.FIRST_ROUNDS_KEPT, isolated._first_rounds = kept, remembered
    shared_repos.KEPT, task_world.SHARED = copies_kept, shared
    same = all(v == verdicts["every round run"] for v in verdicts.values())
    n = len(cases) * args.rounds
    rows = [
        {
            "mode": mode,
            "wall_p50_ms": median(xs) * 1e3,
            "wall_mean_ms": sum(xs) / len(xs) * 1e3,
            "cpu_ms_per_check": cpu[mode] / n * 1e3,
            "checks": n,
        }
        for mode, xs in wall.items()
    ]
    every, remember, share = rows
    res = {
        "rows": rows,
        "wall_ratio": remember["wall_mean_ms"] / every["wall_mean_ms"],
        "cpu_ratio": remember["cpu_ms_per_check"] / every["cpu_ms_per_check"],
        "shared_wall_ratio": share["wall_mean_ms"] / remember["wall_mean_ms"],
        "shared_wall_p50_ratio": share["wall_p50_ms"] / remember["wall_p50_ms"],
        "shared_cpu_ratio": share["cpu_ms_per_check"] / remember["cpu_ms_per_check"],
        "same_verdicts": same,
        "passed": sum(v["reward"] == 1.0 for v in verdicts["and the repository shared"]),
        "loadavg_1m": load,
    }
    print(format_table(rows, ["mode", "wall_p50_ms", "wall_mean_ms", "cpu_ms_per_check", "checks"]))
    print(
        f"remembered / run: wall {res['wall_ratio']:.2f}, host CPU {res['cpu_ratio']:.2f}; "
        f"shared / a fresh copy: wall {res['shared_wall_ratio']:.2f} (medians {res['shared_wall_p50_ratio']:.2f}), "
        f"host CPU {res['shared_cpu_ratio']:.2f}; same verdicts: {same} ({res['passed']} of {n} passed); "
        f"load average {load:.2f}"
    )
    write_json(args.json, res)
    return 0 if same else 1
