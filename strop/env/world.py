"""A task's world: its OS image (`strop.env.image`) and its starting repository (`strop.env.repo`),
opened as a sandbox. The one way an episode, the checker, the judge and `strop tasks` open a task.

The repository a sandbox mounts at WORKDIR is the node's cached checkout itself (read-only, shared
by every sandbox of that commit: the sandbox's overlay takes the writes) when the task has a `repo`
and no `files`; otherwise a scratch directory holding the task's files (over a copy of the checkout
when it has both), removed when the sandbox closes.
"""

import contextlib
import functools
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from strop.beneath import apply_changes
from strop.env.host_account import hand_over
from strop.env.image import image_root
from strop.env.overlay import copy_tree
from strop.env.repo import apply_patch, checkout
from strop.env.sandbox import Limits, Sandbox, open_sandbox, scratch_dir
from strop.env.suites.edits import reference_edit
from strop.env.task import Task


def materialize(task: Task, root: Path) -> Path:
    """Write the task's whole starting repository under `root` (a new or empty directory): its
    checkout, then its files over it."""
    if task.repo:
        copy_tree(checkout(task.repo, task.base_commit), root)
    root.mkdir(parents=True, exist_ok=True)
    apply_changes(root, task.files)  # never through a link the repository holds
    return root


@contextlib.contextmanager
def task_repository(task: Task, kind: str = "world") -> Iterator[Path]:
    """The directory a sandbox of `task` mounts at WORKDIR (see the module docstring); a scratch
    copy is named after `kind` (`strop.env.sandbox.SCRATCH_KINDS`)."""
    if task.repo and not task.files:
        yield checkout(task.repo, task.base_commit)
        return
    world = scratch_dir(kind)
    try:
        materialize(task, world / "repo")
        hand_over(world)
        yield world / "repo"
    finally:
        shutil.rmtree(world, ignore_errors=True)


@contextlib.contextmanager
def task_sandbox(task: Task, limits: Limits = Limits(), kind: str = "world") -> Iterator[Sandbox]:
    """A fresh sandbox on `task`'s image with its starting repository at WORKDIR; closed on exit."""
    image = image_root(task.image)
    with task_repository(task, kind) as repo:
        sandbox = open_sandbox(repo, limits, image)
        try:
            yield sandbox
        finally:
            sandbox.close()


def empty_sandbox(task: Task, limits: Limits = Limits()) -> contextlib.AbstractContextManager[Sandbox]:
    """A fresh sandbox on `task`'s image with an empty WORKDIR (the judge of values grading)."""
    return task_sandbox(replace(task, repo="", base_commit="", files={}), limits, kind="check")


def hidden_tests(task: Task) -> dict[str, str]:
    """The hidden test files the checker writes into a world: `hidden_tests`, and what `test_patch`
    makes of the pristine repository's files."""
    if not task.test_patch:
        return task.hidden_tests
    return {
        **_patched(task.repo, task.base_commit, tuple(sorted(task.files.items())), task.test_patch),
        **task.hidden_tests,
    }


@functools.lru_cache(maxsize=1024)
def _patched(repo: str, commit: str, files: tuple, patch: str) -> dict[str, str]:
    task = Task(id="", suite="", split="eval", instruction="", files=dict(files), repo=repo, base_commit=commit)
    with task_repository(task) as tree:
        return {p: d.decode(errors="replace") for p, d in apply_patch(tree, patch).items() if d is not None}


def repository_has(task: Task, top: str) -> bool:
    """Whether the task's starting repository has the top-level entry `top`."""
    if any(f == top or f.startswith(top + "/") for f in task.files):
        return True
    return bool(task.repo) and (checkout(task.repo, task.base_commit) / top).exists()


def _entries(root: Path) -> tuple[dict[str, Path], list[str]]:
    """Under `root`, without following a symlink and skipping `.git` and caches: relative path ->
    path of every regular file, and the relative paths of everything else that is not a directory
    (symlinks, fifos, sockets, devices)."""
    regular, others = {}, []
    for dirpath, dirnames, filenames in os.walk(root):
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


def _read_nofollow(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def workspace_changes(task: Task, final: Path) -> tuple[dict[str, bytes | None], list[str]]:
    """The directory `final` as an agent's workspace: its changes against the task's starting
    repository (relative path -> bytes, None = deleted), and the entries that are not regular files
    (symlinks, fifos), which are left out: reading through a symlink would read the host."""
    after, skipped = _entries(final)
    with task_repository(task) as start:
        before = _entries(start)[0]
        changes: dict[str, bytes | None] = {}
        for rel, path in after.items():
            data = _read_nofollow(path)
            if rel not in before or _read_nofollow(before[rel]) != data:
                changes[rel] = data
        changes.update({rel: None for rel in before if rel not in after and rel not in skipped})
    return changes, skipped


def starting_text(task: Task, path: str) -> str:
    """The text of `path` in the task's starting repository ("" when it has no such file)."""
    if path in task.files:
        return task.files[path]
    if task.repo:
        file = checkout(task.repo, task.base_commit) / path
        if file.is_file() and not file.is_symlink():
            return file.read_text(errors="replace")
    return ""


def gold_changes(task: Task) -> dict[str, bytes | None]:
    """The changes of `task`'s gold patch to its starting repository (relative path -> new bytes,
    None = deleted; UserError if it does not apply)."""
    with task_repository(task) as tree:
        return apply_patch(tree, task.gold_patch)


def reference_edits(task: Task) -> list[dict]:
    """The task's reference solution as exact search/replace edits ({"path", "old", "new"}; an empty
    `old` writes a new file): the metadata's, else one per file its gold patch changes (deletions
    left out). What the demonstrator plays."""
    if task.metadata.get("reference_edits"):
        return task.metadata["reference_edits"]
    if not task.gold_patch:
        return []
    edits = []
    for path, new in sorted(gold_changes(task).items()):
        old = starting_text(task, path)
        if new is None:
            continue
        new_text = new.decode(errors="replace")
        if not old:
            edits.append({"path": path, "old": "", "new": new_text})
        elif old != new_text:
            a, b = reference_edit(old, new_text)
            edits.append({"path": path, "old": a, "new": b})
    return edits
