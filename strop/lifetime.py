"""Worker processes that do not outlive the process that started them.

A parent that dies without running its cleanup (SIGKILL, the OOM killer) cannot stop its
children, and a spawned trainer or rank would otherwise go on computing for nobody, holding its
memory and cores. `exit_with_parent` makes such a child end itself: the sentinel
`multiprocessing` gives every child reads end-of-file once the parent is gone.
And the other way round: `process_gone` tells what a dead process left behind (named by its
pid), so that the next process may sweep it.
"""

import multiprocessing
import os
import threading
from multiprocessing.connection import wait


def exit_with_parent(exit_code: int = 1) -> None:
    """In a `multiprocessing` child: exit at once (no cleanup; the parent's checkpoints are atomic)
    when the parent process dies. A no-op in a process `multiprocessing` did not start."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(exit_code)

    threading.Thread(target=watch, name="strop-parent-watch", daemon=True).start()


def process_gone(pid: str) -> bool:
    """True when `pid`, as written in the name of a file a process left (its temp files, build and
    scratch directories, cgroups), is a number naming no live process on this host's pid namespace:
    what that owner left may be swept, it will not finish it."""
    return pid.isdigit() and not os.path.exists(f"/proc/{pid}")
