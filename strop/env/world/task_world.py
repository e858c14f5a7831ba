"""A task's world: its OS image (`strop.env.world.image`) and its starting repository (`strop.env.world.repo`),
opened as a sandbox. The one way an episode, the checker, the judge and `strop tasks` open a task.

The repository a sandbox mounts at WORKDIR is the node's cached checkout itself (read-only, shared
by every sandbox of that commit: the sandbox's overlay takes the writes) when the task has a `repo`
and no `files`; otherwise a scratch directory holding the task's files (over a copy of the checkout
when it has both), as read-only and as shared: one per content in this process, kept for the next
sandbox of the task (`strop.env.world.shared_repos`).
"""

import contextlib
import functools
import json
import os
import shlex
import stat
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from strop.confined import apply_changes, copy_tree, lstat_beneath, read_regular, walk
from strop.env.sandbox.backend import open_sandbox
from strop.env.sandbox.interface import WORKDIR, ExecResult, Limits, Sandbox
from strop.env.task import Task
from strop.env.world.image import image_root
from strop.env.world.repo import apply_patch, checkout, commit_start
from strop.env.world.shared_repos import SHARED
from strop.memo import content_key


def materialize(task: Task, root: Path) -> Path:
    """Write the task's whole starting repository under `root` (a new or empty directory): its
    checkout with its start patch applied (and committed: see `commit_start`), then its files over it."""
    if task.repo:
        copy_tree(checkout(task.repo, task.base_commit), root)
    root.mkdir(parents=True, exist_ok=True)
    if task.start_patch:
        apply_changes(root, apply_patch(root, task.start_patch))
        commit_start(root)
    apply_changes(root, task.files)  # never through a link the repository holds
    return root


@contextlib.contextmanager
def task_repository(task: Task) -> Iterator[Path]:
    """The directory a sandbox of `task` mounts at WORKDIR (see the module docstring), never to be
    written: it stays while the block runs."""
    if task.repo and not task.files and not task.start_patch:
        yield checkout(task.repo, task.base_commit)
        return
    base = str(checkout(task.repo, task.base_commit)) if task.repo else ""  # named by its content
    files = [part for path, data in sorted(task.files.items()) for part in (path, content_key(data))]
    with SHARED.use(content_key(base, task.start_patch, *files), lambda root: materialize(task, root)) as repo:
        yield repo


@contextlib.contextmanager
def task_sandbox(task: Task, limits: Limits = Limits()) -> Iterator[Sandbox]:
    """A fresh sandbox on `task`'s image with its starting repository at WORKDIR; closed on exit."""
    image = image_root(task.image)
    with task_repository(task) as repo:
        sandbox = open_sandbox(repo, limits, image)
        try:
            yield sandbox
        finally:
            sandbox.close()


def recipe_env(task: Task) -> dict[str, str]:
    """The environment the task's recipe gives every command of its world: its paths on PYTHONPATH."""
    if not task.recipe.paths:
        return {}
    return {"PYTHONPATH": ":".join(f"{WORKDIR}/{p}" for p in task.recipe.paths)}


def prepare_world(sandbox: Sandbox, task: Task, timeout: float) -> ExecResult | None:
    """Make the repository in `sandbox` importable as the task's recipe says (`strop.env.recipe`):
    its paths exported in the shell's startup file (so the agent's commands see them too), then its
    setup commands, in the repository. None when there is nothing to do; else the run, which failed
    when its exit code is not 0 (the first failing command stops it)."""
    if not task.recipe:
        return None
    lines = ["set -e"]
    lines += [f"echo {shlex.quote(f'export {k}={shlex.quote(v)}')} >> ~/.bashrc" for k, v in recipe_env(task).items()]
    return sandbox.exec("\n".join([*lines, *task.recipe.setup]), timeout=timeout, env=recipe_env(task))


def empty_sandbox(task: Task, limits: Limits = Limits()) -> contextlib.AbstractContextManager[Sandbox]:
    """A fresh sandbox on `task`'s image with an empty WORKDIR (the judge of values grading)."""
    return task_sandbox(replace(task, repo="", base_commit="", files={}), limits)


def repository_has(task: Task, path: str) -> bool:
    """Whether the task's starting repository has an entry at `path` (a file, a directory, a link;
    found without following a link)."""
    if any(f == path or f.startswith(path + "/") for f in task.files):
        return True
    return bool(task.repo) and lstat_beneath(checkout(task.repo, task.base_commit), path) is not None


# the top-level modules an interpreter can import with no repository on its path
_MODULES = (
    "import json, pkgutil, sys; print(json.dumps(sorted({*sys.builtin_module_names, "
    "*getattr(sys, 'stdlib_module_names', ()), *(m.name for m in pkgutil.iter_modules())})))"
)


def installed_modules(image: str) -> frozenset[str]:
    """The top-level modules the `python3` of the image `image` (a task's `image`) has: its standard
    library and its site-packages, everything a module of the repository could stand in for."""
    return _installed_modules(image_root(image))


@functools.cache
def _installed_modules(root: str) -> frozenset[str]:
    task = Task(id="", suite="", split="eval", instruction="", image=root)
    with empty_sandbox(task, Limits(timeout_s=60)) as sandbox:
        run = sandbox.exec(["python3", "-I", "-c", _MODULES])
    try:
        names = json.loads(run.stdout) if run.exit_code == 0 else []
    except ValueError:
        names = []
    # no python3 (the image runs no Python tests either), or one that answers nonsense: nothing to stand in for
    return frozenset(n for n in names if isinstance(n, str)) if isinstance(names, list) else frozenset()


def _entries(root: Path) -> tuple[dict[str, Path], list[str]]:
    """Under `root`, without following a symlink and skipping `.git` and caches: relative path ->
    path of every regular file, and the relative paths of everything else that is not a directory
    (symlinks, fifos, sockets, devices)."""
    regular, others = {}, []
    for dirpath, dirnames, filenames in walk(root):
        others += [
            os.path.relpath(os.path.join(dirpath, d), root)
            for d in dirnames
            if os.path.islink(os.path.join(dirpath, d))
        ]
        dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__", ".pytest_cache")]
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if not stat.S_ISREG(os.lstat(path).st_mode):
                others.append(rel)
            elif not name.endswith(".pyc"):
                regular[rel] = path
    return regular, sorted(others)


def workspace_changes(task: Task, final: Path) -> tuple[dict[str, bytes | None], list[str]]:
    """The directory `final` as an agent's workspace: its changes against the task's starting
    repository (relative path -> bytes, None = deleted), and the entries that are not regular files
    (symlinks, fifos), which are left out: reading through a symlink would read the host."""
    after, skipped = _entries(final)
    with task_repository(task) as start:
        before = _entries(start)[0]
        changes: dict[str, bytes | None] = {}
        for rel, path in after.items():
            data = read_regular(path)
            if data is None:  # replaced by a link or a fifo since the walk: not the agent's code
                skipped.append(rel)
            elif rel not in before or read_regular(before[rel]) != data:
                changes[rel] = data
        changes.update({rel: None for rel in before if rel not in after and rel not in skipped})
    return changes, skipped
