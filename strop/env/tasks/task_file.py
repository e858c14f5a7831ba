"""Task files: one JSON object per line, a superset of SWE-bench's instance fields, read as the suite
`jsonl:PATH` (and written by `strop tasks mine`).

Fields (SWE-bench's names where it has one):
- `instance_id` (str, required, unique): the task id.
- `problem_statement` (str, required): the instruction the agent gets.
- `repo` (str): the starting repository: a git repository (a directory, a bundle file or a URL)
  checked out at `base_commit`, a plain directory, or a tarball. Relative paths are relative to
  the task file. A SWE-bench `owner/name` is such a relative path: keep clones beside the file.
- `base_commit` (str): the commit to check out (required for a git `repo`).
- `files` (object path -> text): files written over the repository (or the whole repository).
- `patch` (str): the reference solution as a unified diff (the gold patch).
- `test_patch` (str): a unified diff adding the hidden tests; `hidden_tests` (object path -> text)
  gives them whole instead.
- `FAIL_TO_PASS`, `PASS_TO_PASS` (lists of test ids, or SWE-bench's JSON-encoded lists): the tests
  the checker runs; every one must pass.
- `image` (str): the OS image (`strop.env.world.image`; a relative path starts at the task file); absent
  = the run's default (`rollout.image`).
- `split` ("train" or "eval"): absent = the task is in both.
- `recipe` (object): how the repository is made importable, `{"paths": [...], "setup": [...]}`
  (`strop.env.recipe`): directories put on Python's import path, and shell commands run in the
  world before the tests and before the agent's first turn. Absent = nothing to do.
- `start_patch` (str): a unified diff applied to the repository at `base_commit` to make the
  starting state (a synthesized task's bug, `strop tasks synth`); `patch` then undoes it.
- `difficulty` (int), `test_command` (list of str), `protected` (list of globs), `grader`
  ("pytest" or "values"), `metadata` (object): as in `strop.env.task.Task`.
Any other field is kept in the task's metadata (SWE-bench's `version`, `created_at`, ...), unless
it looks like a misspelt known field, which is an error. Errors name the file, line and field.

A task file is untrusted data (datasets are downloaded): naming the file names its directory, and
nothing else. Its `repo` and `image` must resolve (links followed) inside the task file's
directory, or inside a directory the user lists in `STROP_TASK_SOURCES` (whitespace-separated
directories and URL prefixes); a URL only under a prefix listed there, so a task file fetches
nothing on its own. Checked up front: `files` and `hidden_tests` keys and the files of test ids
are plain relative paths (a test id never starts with `-`: it is an argument of the test command),
and the limits a task asks for itself (`timeout_s`, `cpu_s`, `memory_mb`, top level or in
`metadata`) are positive numbers within `CEILINGS`.
"""

import difflib
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from strop.confined import parts_of
from strop.env.host.node_cache import is_url
from strop.env.recipe import Recipe, check_path
from strop.env.runner import TEST_COMMAND
from strop.env.task import Task
from strop.errors import UserError
from strop.jsonl import read_records
from strop.memo import by_version

_STR, _LIST, _MAP = "a string", "a list of strings", "an object of path -> text"
SOURCES_ENV = "STROP_TASK_SOURCES"  # directories and URL prefixes a task file may name beyond its own directory
# the most a task may ask for itself: a task file cannot hold a worker forever nor take a node's memory
CEILINGS = {"timeout_s": 3600.0, "cpu_s": 7200, "memory_mb": 65536}
FIELDS: dict[str, str] = {
    "instance_id": _STR,
    "problem_statement": _STR,
    "repo": _STR,
    "base_commit": _STR,
    "files": _MAP,
    "patch": _STR,
    "test_patch": _STR,
    "hidden_tests": _MAP,
    "FAIL_TO_PASS": _LIST,
    "PASS_TO_PASS": _LIST,
    "image": _STR,
    "split": '"train" or "eval"',
    "difficulty": "an integer",
    "test_command": _LIST,
    "protected": _LIST,
    "grader": '"pytest" or "values"',
    "metadata": "an object",
    "recipe": 'an object {"paths": [...], "setup": [...]} of lists of strings',
    "start_patch": _STR,
}


def _check(where: str, name: str, value: Any) -> Any:
    """`value` of field `name`, checked against its type (SWE-bench's JSON-encoded lists decoded)."""
    kind = FIELDS[name]
    bad = UserError(f"{where}: field {name!r} must be {kind}, got {type(value).__name__} {str(value)[:60]!r}")
    if kind == _LIST and isinstance(value, str) and name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise bad from None
    if kind == _STR and not isinstance(value, str):
        raise bad
    if kind == _LIST and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise bad
    if kind == _MAP and not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
        raise bad
    if name == "split" and value not in ("train", "eval"):
        raise bad
    if name == "grader" and value not in ("pytest", "values"):
        raise bad
    if name == "difficulty" and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad
    if name == "metadata" and not isinstance(value, dict):
        raise bad
    if name == "recipe":
        if not isinstance(value, dict) or set(value) - {"paths", "setup"}:
            raise bad
        if not all(isinstance(v, list) and all(isinstance(x, str) and x for x in v) for v in value.values()):
            raise bad
        return Recipe(
            paths=tuple(check_path(f"{where}: field 'recipe'", p) for p in value.get("paths", [])),
            setup=tuple(value.get("setup", [])),
        )
    return value


def _source(where: str, name: str, value: str, base_dir: Path) -> str:
    """The repository or image `value` of field `name` as a path or URL strop may open for a task
    file in `base_dir` (see the module docstring), or UserError."""
    if not value or (name == "image" and value == "/"):
        return value
    allowed = os.environ.get(SOURCES_ENV, "").split()
    if is_url(value):
        if any(value.startswith(prefix) for prefix in allowed if is_url(prefix)):
            return value
        raise UserError(
            f"{where}: field {name!r}: a task file fetches no URL on its own ({value[:80]!r}); "
            f"allow its prefix with {SOURCES_ENV}"
        )
    path = (base_dir / value).resolve()
    roots = [base_dir.resolve(), *(Path(a).resolve() for a in allowed if not is_url(a))]
    if not any(path == root or root in path.parents for root in roots):
        raise UserError(
            f"{where}: field {name!r}: {value!r} is outside the task file's directory {base_dir}; a task file "
            f"names only what is inside it (allow other directories with {SOURCES_ENV})"
        )
    if not path.exists():
        what = "repository" if name == "repo" else "image"
        raise UserError(f"{where}: field {name!r}: no {what} at {path} (relative paths start at the task file)")
    return str(path)


def _plain_path(where: str, name: str, path: str) -> None:
    """UserError unless `path`, a key of field `name` (or a test id's file), is a plain relative path."""
    try:
        parts_of(path)
    except UserError:
        raise UserError(f"{where}: field {name!r}: {path[:80]!r} is not a plain relative path") from None
    if path.startswith("-"):  # a test id is an argument of the test command: never one of its options
        raise UserError(f"{where}: field {name!r}: {path[:80]!r} starts with '-'")


def _check_limits(where: str, metadata: dict) -> None:
    """UserError unless the limits a task asks for itself are numbers within `CEILINGS`."""
    for key, ceiling in CEILINGS.items():
        if key not in metadata:
            continue
        value = metadata[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or not 0 < value <= ceiling or (key != "timeout_s" and value != int(value)):
            kind = "seconds" if key != "memory_mb" else "MB"
            raise UserError(
                f"{where}: field {key!r} must be a positive number of {kind} up to {ceiling}, got {value!r}"
            )
    for key in ("n_tests", "n_perturbed_tests"):
        if key in metadata and (type(metadata[key]) is not int or metadata[key] < 0):
            raise UserError(f"{where}: field {key!r} must be a count, got {metadata[key]!r}")


def task_from_record(record: Any, where: str, base_dir: Path, suite: str) -> tuple[Task, bool]:
    """The Task a task-file line describes, and whether it named its split. `where` prefixes errors
    ("tasks.jsonl:3"); relative repository paths resolve against `base_dir`."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: a task is a JSON object, got {type(record).__name__}")
    for name in ("instance_id", "problem_statement"):
        if name not in record:
            raise UserError(f"{where}: missing field {name!r}")
    extra = {}
    for name in record:
        if name in FIELDS:
            continue
        near = difflib.get_close_matches(name, FIELDS, n=1, cutoff=0.85) or [
            f for f in FIELDS if f.lower() == name.lower()
        ]
        if near:
            raise UserError(f"{where}: unknown field {name!r} (did you mean {near[0]!r}?)")
        extra[name] = record[name]
    r = {name: _check(where, name, value) for name, value in record.items() if name in FIELDS}
    if not r["instance_id"]:
        raise UserError(f"{where}: field 'instance_id' is empty")
    repo = _source(where, "repo", r.get("repo", ""), base_dir)
    image = _source(where, "image", r.get("image", ""), base_dir)
    if not repo and "files" not in r:
        raise UserError(f"{where}: a task needs a starting repository: field 'repo' or 'files'")
    if r.get("base_commit") and not repo:
        raise UserError(f"{where}: field 'base_commit' without a 'repo'")
    if r.get("start_patch") and not repo:
        raise UserError(f"{where}: field 'start_patch' without a 'repo'")
    tests = r.get("FAIL_TO_PASS", []) + r.get("PASS_TO_PASS", [])
    if not tests and not r.get("hidden_tests") and not r.get("test_patch"):
        raise UserError(f"{where}: a task needs hidden tests: FAIL_TO_PASS, 'hidden_tests' or 'test_patch'")
    metadata = {**r.get("metadata", {}), **extra}
    for name in (*r.get("files", {}), *r.get("hidden_tests", {})):
        _plain_path(where, "files" if name in r.get("files", {}) else "hidden_tests", name)
    for test in tests:
        _plain_path(where, "FAIL_TO_PASS" if test in r.get("FAIL_TO_PASS", []) else "PASS_TO_PASS", test.split("::")[0])
    _check_limits(where, metadata)
    if "difficulty" in r:
        metadata["difficulty"] = r["difficulty"]
    if tests:
        metadata.setdefault("n_tests", len(tests))
    task = Task(
        id=r["instance_id"],
        suite=suite,
        split=r.get("split", "eval"),
        instruction=r["problem_statement"],
        files=r.get("files", {}),
        hidden_tests=r.get("hidden_tests", {}),
        test_command=r.get("test_command", list(TEST_COMMAND)),
        metadata=metadata,
        grader=r.get("grader", "pytest"),
        image=image,
        repo=repo,
        base_commit=r.get("base_commit", ""),
        test_patch=r.get("test_patch", ""),
        fail_to_pass=r.get("FAIL_TO_PASS", []),
        pass_to_pass=r.get("PASS_TO_PASS", []),
        gold_patch=r.get("patch", ""),
        recipe=r.get("recipe", Recipe()),
        start_patch=r.get("start_patch", ""),
    )
    if "protected" in r:
        task.protected = r["protected"]
    return task, "split" in r


def task_record(task: Task, base_dir: Path | None = None) -> dict:
    """The task-file line of `task` (the inverse of `task_from_record`); repository and image paths
    are written relative to `base_dir` when given."""

    def relative(path: str) -> str:
        return os.path.relpath(path, base_dir) if path and base_dir is not None and not is_url(path) else path

    repo, image = relative(task.repo), relative(task.image) if task.image != "/" else task.image
    record: dict = {"instance_id": task.id, "problem_statement": task.instruction}
    if repo:
        record.update(repo=repo, base_commit=task.base_commit)
    fields = {
        "files": task.files,
        "patch": task.gold_patch,
        "test_patch": task.test_patch,
        "hidden_tests": task.hidden_tests,
        "FAIL_TO_PASS": task.fail_to_pass,
        "PASS_TO_PASS": task.pass_to_pass,
        "image": image,
        "recipe": task.recipe.to_record(),
        "start_patch": task.start_patch,
    }
    record.update({k: v for k, v in fields.items() if v})
    record["split"] = task.split
    meta = dict(task.metadata)
    if "difficulty" in meta:
        record["difficulty"] = meta.pop("difficulty")
    record.update(test_command=task.test_command, protected=task.protected, grader=task.grader)
    if meta:
        record["metadata"] = meta
    return record


@by_version(maxsize=16)
def _read(path: str) -> tuple[tuple[Task, bool], ...]:
    out, seen = [], set()
    for where, record in read_records(path, "task file"):
        task, has_split = task_from_record(record, where, Path(path).parent, f"jsonl:{path}")
        if task.id in seen:
            raise UserError(f"{where}: instance_id {task.id!r} appears twice")
        seen.add(task.id)
        out.append((task, has_split))
    if not out:
        raise UserError(f"task file {path} holds no tasks")
    return tuple(out)


def read_tasks(path: str | Path) -> list[tuple[Task, bool]]:
    """(task, named its split) for every line of a task file; parsed once per file version."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"task file {str(p)!r} does not exist")
    return list(_read(str(p.resolve())))


class TaskFileSuite:
    """The suite `jsonl:PATH`: the tasks of one task file. A task without a `split` is in both."""

    def __init__(self, path: str):
        self.path = path

    def load(self, split: str | None = None) -> list[Task]:
        out = []
        for task, has_split in read_tasks(self.path):
            if has_split:
                out += [task] if split in (None, task.split) else []
            else:
                out += [replace(task, split=s) for s in ([split] if split else ["train", "eval"])]
        return out

    def get(self, task_id: str) -> Task | None:
        return next((t for t, _ in read_tasks(self.path) if t.id == task_id), None)
