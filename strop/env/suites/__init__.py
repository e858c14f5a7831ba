"""strop's built-in task suites, registered under the entry point group `strop.suites` in strop's
pyproject exactly as an environment package registers its own (found by `strop.env.tasks.suites`)."""


def __getattr__(name: str):
    """The suite loader's names lived here before strop.env.tasks.suites: say so in one line."""
    if name in ("load_suite", "draw_tasks", "list_suites", "get_task", "split_name", "suite_module"):
        raise ImportError(f"strop.env.suites.{name} moved to strop.env.tasks.suites.{name}")
    raise AttributeError(f"module 'strop.env.suites' has no attribute {name!r}")
