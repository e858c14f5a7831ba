"""Scratch directories: the host directories a sandbox's world lives in while it is open, named
strop-<kind>-<pid>-* after the process that owns them, and the sweep that removes those of
processes killed before their exit handlers ran.
"""

import os
import tempfile
import warnings
from pathlib import Path

from strop.confined import rmtree
from strop.env.host.account import hand_over, reachable
from strop.env.host.node_cache import cache_dir
from strop.lifetime import process_gone

SCRATCH_KINDS = ("sbx", "world")  # host directories strop-<kind>-<pid>-*, swept when <pid> is dead


def scratch_base() -> Path:
    """Where scratch worlds go: the temp dir, unless the sandbox account cannot enter it (a private
    TMPDIR while strop runs as root), then the node cache's scratch/."""
    base = Path(tempfile.gettempdir())
    if reachable(base):
        return base
    return cache_dir("scratch")


def scratch_dir(kind: str) -> Path:
    """A fresh host directory for a world a sandbox opens (a task's repository, a checker's world),
    named strop-<kind>-<pid>-* in `scratch_base()`, handed to the sandbox account. Its owner removes
    it; when the owner is killed first, the next strop process to start a sandbox removes it (the
    backend's sweep of dead owners')."""
    assert kind in SCRATCH_KINDS, kind
    path = Path(tempfile.mkdtemp(prefix=f"strop-{kind}-{os.getpid()}-", dir=scratch_base()))
    hand_over(path)
    return path


def sweep_dead(*bases: Path) -> None:
    """Remove what processes killed before their exit handlers ran left behind (temp roots named
    strop-sbx-<pid>-*, worlds strop-world-<pid>-* holding a task's repository, see `scratch_dir`):
    a crashed rollout worker must not leak RAM in /dev/shm, nor a killed `strop tasks check` a copy
    of the task in /tmp."""
    for base in bases:
        for d in base.glob("strop-*-*-*"):
            kind, pid = d.name.split("-")[1:3]
            if kind in SCRATCH_KINDS and process_gone(pid):
                try:
                    rmtree(d)  # another process starting at the same time may sweep it too: not an error
                except OSError as e:  # what cannot be removed stays; it never stops a new sandbox
                    warnings.warn(f"could not remove {d}: {e.strerror}", stacklevel=2)
