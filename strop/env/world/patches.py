"""A task's patches read against its starting repository: the hidden tests its `test_patch` makes,
the changes of its gold patch, and its reference solution as exact search/replace edits (how
reference solutions are stored, `metadata["reference_edits"]`: a list of {"path", "old", "new"},
and what the demonstrator plays)."""

import functools

from strop.confined import read_beneath
from strop.env.task import Task
from strop.env.world.repo import apply_patch, checkout
from strop.env.world.task_world import task_repository
from strop.errors import UserError


def reference_edit(buggy: str, fixed: str) -> tuple[str, str]:
    """The smallest whole-line (old, new) replacement turning `buggy` into `fixed`, with `old`
    unique in `buggy` (widened by context lines until it is) so a search/replace edit applies."""
    a, b = buggy.splitlines(keepends=True), fixed.splitlines(keepends=True)
    p = 0
    while p < min(len(a), len(b)) and a[p] == b[p]:
        p += 1
    s = 0
    while s < min(len(a), len(b)) - p and a[-1 - s] == b[-1 - s]:
        s += 1
    while True:
        old, new = "".join(a[p : len(a) - s]), "".join(b[p : len(b) - s])
        if old and buggy.count(old) == 1:
            return old, new
        if p > 0:
            p -= 1
        else:
            s -= 1


def apply_edits(files: dict[str, str], edits: list[dict]) -> dict[str, str]:
    """The changes (path -> new text) that exact search/replace `edits` make to `files`;
    how reference solutions (`metadata["reference_edits"]`) become workspace changes."""
    out: dict[str, str] = {}
    for e in edits:
        text = out.get(e["path"], files.get(e["path"], ""))
        assert text.count(e["old"]) == 1, f"reference edit not unique in {e['path']}"
        out[e["path"]] = text.replace(e["old"], e["new"])
    return out


def hidden_tests(task: Task) -> dict[str, str]:
    """The hidden test files the checker writes into a world: `hidden_tests`, and what `test_patch`
    makes of the pristine repository's files."""
    if not task.test_patch:
        return task.hidden_tests
    try:
        made = _patched(task.repo, task.base_commit, tuple(sorted(task.files.items())), task.test_patch)
    except UserError as e:
        raise UserError(f"task {task.id!r}: field 'test_patch' does not apply: {e}") from None
    return {**made, **task.hidden_tests}


@functools.lru_cache(maxsize=1024)
def _patched(repo: str, commit: str, files: tuple, patch: str) -> dict[str, str]:
    task = Task(id="", suite="", split="eval", instruction="", files=dict(files), repo=repo, base_commit=commit)
    with task_repository(task) as tree:
        return {p: d.decode(errors="replace") for p, d in apply_patch(tree, patch).items() if d is not None}


def starting_text(task: Task, path: str) -> str:
    """The text of `path` in the task's starting repository ("" when it has no such file)."""
    if path in task.files:
        return task.files[path]
    if task.start_patch:
        started = apply_patch(checkout(task.repo, task.base_commit), task.start_patch)
        if path in started:
            return (started[path] or b"").decode(errors="replace")
    if task.repo:
        data = read_beneath(checkout(task.repo, task.base_commit), path, links=False)  # never through a link
        if data is not None:
            return data.decode(errors="replace")
    return ""


def gold_changes(task: Task) -> dict[str, bytes | None]:
    """The changes of `task`'s gold patch to its starting repository (relative path -> new bytes,
    None = deleted; UserError naming the task and the field if it does not apply)."""
    with task_repository(task) as tree:
        try:
            return apply_patch(tree, task.gold_patch)
        except UserError as e:
            raise UserError(f"task {task.id!r}: field 'patch' does not apply: {e}") from None


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
