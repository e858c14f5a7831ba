"""The suite `toy`: small single-bug Python modules, read from the package's `tasks.jsonl` (strop's
task file format, `strop.env.tasks.task_file`). strop calls `load(split)` in the process that draws a
run's tasks, and `get(task_id)` to build one task."""

from pathlib import Path

from strop.env.tasks.task_file import TaskFileSuite

TASKS = TaskFileSuite(str(Path(__file__).with_name("tasks.jsonl")))


def load(split=None):
    """The tasks of one split ("train" or "eval"), or both when None."""
    return TASKS.load(split)


def get(task_id):
    return TASKS.get(task_id)
