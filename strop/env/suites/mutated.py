"""The `mutated` suite: bugs injected into a real installed package that its own shipped tests catch,
synthesized as `strop tasks synth` synthesizes them from any repository (`strop.env.tasks.synth`).

`mutated/PACKAGE` is one package: any installed pure-Python package whose distribution ships its tests
inside it and needs nothing else at run time (toolz does: strop depends on it for this). Build (once):
`strop tasks build --suite mutated/PACKAGE` copies the package's files out of site-packages into a git
repository of its own (one commit, a fixed identity: the same files give the same commit) under
`$STROP_CACHE/suites/mutated/` (default `~/.cache/strop/suites`) and synthesizes up to `--target`
tasks from it on the host's root into `PACKAGE.jsonl` beside it. `mutated` alone is every package
built there. The split is synth's: by function.
"""

import importlib.util
import os
import shutil
from dataclasses import replace
from pathlib import Path

from strop.env.task import Task
from strop.errors import UserError

VARIANT = "an installed package whose tests ship inside it, e.g. mutated/toolz"


def cache_dir() -> Path:
    return Path(os.environ.get("STROP_CACHE", "~/.cache/strop")).expanduser() / "suites" / "mutated"


def package_repository(name: str, root: Path) -> Path:
    """The installed package `name` as a one-commit git repository at `root/name` (made once)."""
    from strop.env.world.repo import git

    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"no installed package {name!r} (mutated/PACKAGE names an installed package)")
    repo = root / name
    if (repo / ".git").is_dir():
        return repo
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    package = Path(next(iter(spec.submodule_search_locations)))
    shutil.copytree(package, tmp / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), symlinks=True)
    git("init", "-q", "-b", "main", cwd=tmp)
    git("add", "-A", cwd=tmp)
    git("commit", "-q", "-m", f"{name} as installed", cwd=tmp)  # git's identity and date are fixed
    tmp.rename(repo)
    return repo


def build(package: str, target: int = 240, jobs: int = 2, progress: bool = True, cache: Path | None = None) -> Path:
    """Synthesize the suite `mutated/package` into the cache (`cache_dir()` or `cache`); returns its task file."""
    from strop.env.tasks.synth import synth

    root = Path(cache) if cache else cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{package}.jsonl"
    synth(str(package_repository(package, root)), out, max_tasks=target, jobs=jobs, progress=progress)
    return out


def load(split: str | None = None, variant: str = "", cache: Path | str | None = None) -> list[Task]:
    from strop.env.tasks.task_file import TaskFileSuite

    root = Path(cache) if cache else cache_dir()
    files = [root / f"{variant}.jsonl"] if variant else sorted(root.glob("*.jsonl"))
    built = [f for f in files if f.is_file()]
    if not built:
        what = f"mutated/{variant}" if variant else "mutated"
        raise UserError(f"the suite {what} is not built in {root}; run `strop tasks build --suite mutated/PACKAGE`")
    return [replace(t, suite="mutated") for f in built for t in TaskFileSuite(str(f)).load(split)]
