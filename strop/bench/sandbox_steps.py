"""Where a task sandbox's open and close spend their time (`strop bench sandbox`'s step table).

One run is what every sandbox of an episode, the checker and the judge does: `task_sandbox` on a
task of the demo's suite (`synthetic/parse`), its first command (`true`), and its close. Each step
is timed where it happens (its function wrapped for the run): the world (a scratch directory, the
task's files written, handed to the sandbox account, removed), the sandbox's copy-on-write layer
directories, bwrap started (`Popen`, through the spawner thread), bwrap's report of its child, the
rest of the first command (bwrap's namespaces and mounts, the server's start, one round trip), the
kill and reap, the layer directories removed. The two ways of getting the world are timed
alternately in one run: a fresh copy per sandbox (`strop.env.world.shared_repos.KEPT = 0`, as before
copies were shared), and the copy shared by the task's sandboxes.

With `busy_threads`, that many Python threads spin beside, as the RL loop's process runs its engines
and rollout workers as threads: a thread back from a system call that blocked (a removal waiting
for the disk, a wait for a child) then waits for the GIL until the running thread yields it, up to
the switch interval (5 ms), so a step costs about that per blocking call it makes.
"""

import contextlib
import functools
import time
from collections import defaultdict
from statistics import median
from typing import Iterator

MODES = ("fresh copy", "shared copy")


@contextlib.contextmanager
def _timed(owner, name: str, into: dict[str, float], step: str) -> Iterator[None]:
    """`owner.name` wrapped so that its calls add their seconds to `into[step]`."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into[step] += time.perf_counter() - t0

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _one(task, steps: dict[str, float]) -> None:
    from strop.env.world.task_world import task_sandbox

    t0 = time.perf_counter()
    with task_sandbox(task) as sandbox:
        t1 = time.perf_counter()
        sandbox.exec(["true"])
        t2 = time.perf_counter()
    t3 = time.perf_counter()
    steps["open"] += t1 - t0
    steps["first command"] += t2 - t1
    steps["close"] += t3 - t2


def step_times(runs: int, busy_threads: int = 0) -> dict:
    """Per mode: each step's median milliseconds over `runs` sandboxes, and the whole's median and
    mean, with `busy_threads` Python threads spinning beside."""
    from strop.bench.busy_threads import busy_threads as spinning
    from strop.env.suites.synthetic import make_task, parse_themes
    from strop.env.world import shared_repos, task_world

    task = make_task(1, "eval", 0, parse_themes("parse"))
    kept, shared = shared_repos.KEPT, task_world.SHARED
    per_mode: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with spinning(busy_threads):
        _runs(task, runs, per_mode)
    shared_repos.KEPT, task_world.SHARED = kept, shared
    return {mode: _summary(of) for mode, of in per_mode.items()}


def _runs(task, runs: int, per_mode: dict[str, list[dict[str, float]]]) -> None:
    from strop.env.sandbox.bwrap import BwrapSandbox
    from strop.env.world import shared_repos, task_world

    kept, shared = shared_repos.KEPT, task_world.SHARED
    fresh = shared_repos.SharedRepositories()  # of its own: the shared mode's copy stays in the other
    for i in range(runs + 2):  # the first two warm (the image's root, the sandbox account)
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            shared_repos.KEPT, task_world.SHARED = (0, fresh) if mode == MODES[0] else (kept, shared)
            steps: dict[str, float] = defaultdict(float)
            with contextlib.ExitStack() as stack:
                for owner, name, step in (
                    (shared_repos, "scratch_dir", "world: scratch directory"),
                    (task_world, "materialize", "world: the task's files written"),
                    (shared_repos, "hand_over", "world: handed to the sandbox account"),
                    (shared_repos, "rmtree", "world: removed"),
                    (BwrapSandbox, "_spawn", "bwrap started (Popen)"),
                    (BwrapSandbox, "_init_pid", "bwrap's child reported"),
                    (BwrapSandbox, "_kill", "close: kill and reap"),
                ):
                    stack.enter_context(_timed(owner, name, steps, step))
                _one(task, steps)
            if i >= 2:
                per_mode[mode].append(steps)


WORLD_MADE = ("world: scratch directory", "world: the task's files written", "world: handed to the sandbox account")
STEPS = (
    *WORLD_MADE,
    "layer directories made",
    "bwrap started (Popen)",
    "bwrap's child reported",
    "first command: namespaces, mounts, server",
    "close: kill and reap",
    "close: layer directories removed",
    "world: removed",
)


def _summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each step's median milliseconds (what the timed functions do not cover, the bookkeeping
    around them, counted with the layer directories), the whole's median and mean."""
    rows = []
    for s in runs:
        made = sum(s[k] for k in WORLD_MADE)
        row = {k: s[k] for k in STEPS if k in s}
        row["layer directories made"] = s["open"] - made - s["bwrap started (Popen)"]
        row["first command: namespaces, mounts, server"] = s["first command"] - s["bwrap's child reported"]
        row["close: layer directories removed"] = s["close"] - s["close: kill and reap"] - s["world: removed"]
        row["whole"] = s["open"] + s["first command"] + s["close"]
        rows.append(row)
    return {
        **{f"{k} p50_ms": median(r.get(k, 0.0) for r in rows) * 1e3 for k in (*STEPS, "whole")},
        "whole mean_ms": sum(r["whole"] for r in rows) / len(rows) * 1e3,
    }
