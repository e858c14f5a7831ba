"""The environment: where an episode happens and how it is scored, one sub-package per subsystem,
ordered low to high (`tests/test_layering.py` enforces the order):

- `host`: the account sandboxes run as, the node cache (images, repositories, downloads), scratch
  directories;
- `sandbox`: the sandbox interface and its bubblewrap backend, pools, parity with the host;
- `world`: OS images and their layers, repositories at a commit, a task's world opened as a
  sandbox, a task's patches;
- `harness` (the agent loop, tools, chat formats, context strategies, sessions) and `grading` (the
  reward checker, isolated grading, the hack monitor, behaviour statistics);
- `tasks`: where tasks come from: suites found by name, task files, mining a repository's history,
  synthesizing bugs into its code;
- `suites`: strop's built-in suites, registered like a user's;
- `demonstrators`: scripted policies that play tasks for the SFT warm start.

The records every sub-package passes around sit at the top: `task` (Task), `episode` (Segment,
Episode), `recipe` (how a task's repository is made importable), `runner` (the test runner),
`plugins` (finding an extension by name). The environment knows nothing of the trainer
or of a particular engine: the harness is handed a policy client.

A module that moved when the package was split (strop.env.tools, strop.env.sandbox's names, ...) is
refused on import with one line naming its new place.
"""

import importlib.abc
import sys

MOVED = {  # old module -> its new place (a module, or the modules its names went to)
    "bwrap": "strop.env.sandbox.bwrap",
    "bwrap_host": "strop.env.sandbox.host_state and strop.env.host.scratch",
    "bwrap_layout": "strop.env.sandbox.layout",
    "bwrap_protocol": "strop.env.sandbox.exec_protocol",
    "bwrap_spawner": "strop.env.sandbox.spawner",
    "ctty": "strop.env.sandbox.ctty",
    "sched_slice": "strop.env.sandbox.sched_slice",
    "sandbox_python": "strop.env.sandbox.python",
    "pool": "strop.env.sandbox.pool",
    "parity": "strop.env.sandbox.parity",
    "overlay": "strop.env.sandbox.overlay and strop.confined",
    "host_account": "strop.env.host.account and strop.env.host.node_cache",
    "layers": "strop.env.world.layers",
    "image": "strop.env.world.image",
    "repo": "strop.env.world.repo",
    "tools": "strop.env.harness.tools",
    "coding_tools": "strop.env.harness.coding_tools",
    "chat_formats": "strop.env.harness.chat_formats",
    "context": "strop.env.harness.context",
    "sessions": "strop.env.harness.sessions",
    "segment": "strop.env.episode",
    "checker": "strop.env.grading.checker",
    "isolated_grading": "strop.env.grading.isolated",
    "grading_programs": "strop.env.grading.programs",
    "hacks": "strop.env.grading.hack_monitor",
    "behaviour": "strop.env.grading.behaviour",
    "task_file": "strop.env.tasks.task_file",
    "mine": "strop.env.tasks.mine",
    "touched_tests": "strop.env.tasks.touched_tests",
    "oracle": "strop.env.demonstrators",
    "chain_oracle": "strop.env.demonstrators.chain",
    "suites.edits": "strop.env.world.patches",
}


class _Moved(importlib.abc.MetaPathFinder):
    """Refuses an old module path with one line that names the new one."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("strop.env.")
        if fullname.startswith("strop.env.") and old in MOVED:
            raise ModuleNotFoundError(f"{fullname} moved to {MOVED[old]}", name=fullname)
        return None


sys.meta_path.append(_Moved())
