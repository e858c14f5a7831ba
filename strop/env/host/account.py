"""The host account a sandbox's user runs as.

A sandbox's user (`dev`, uid 1000 inside) is one host account: the caller's own when strop runs as
a regular user (bubblewrap can map no other), and the unprivileged `nobody` (SANDBOX_UID) when strop
runs as root, so that host files keep their owners' permissions inside (a root-only file stays
unreadable; mapping to root, the sandbox user owned every root file). Bubblewrap then runs as that
account too, so every host path a sandbox mounts must be reachable by it: the directories strop
makes for worlds are handed to it (`hand_over`), and the node cache lives where it can enter
(`strop.env.host.node_cache`).
"""

import os
import stat
from pathlib import Path

from strop.confined import walk

SANDBOX_UID = SANDBOX_GID = 65534  # nobody / nogroup: the account sandboxes run as when strop runs as root


def as_root() -> bool:
    return os.geteuid() == 0


def sandbox_account() -> tuple[int, int]:
    """(uid, gid) on the host of a sandbox's user."""
    return (SANDBOX_UID, SANDBOX_GID) if as_root() else (os.geteuid(), os.getegid())


def reachable(path: Path) -> bool:
    """Whether the sandbox account can enter every directory on the way to `path` (and `path`)."""
    uid, gid = sandbox_account()
    p = Path(os.path.abspath(path))
    for d in [*reversed(p.parents), p]:
        try:
            st = os.stat(d)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            continue
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def ready_for_sandbox(repo_dir: Path) -> bool:
    """Whether the sandbox account can mount `repo_dir` and edit it as its own: always for a regular
    user (it is the sandbox account); as root, a directory handed over (`hand_over`) on a reachable path."""
    if not as_root():
        return True
    return reachable(repo_dir) and os.stat(repo_dir).st_uid == SANDBOX_UID


def hand_over(path: Path) -> None:
    """Make the tree `path` the sandbox account's (symlinks themselves, never their targets), as
    the files of a repository are its developer's. A no-op when they are ours already."""
    if not as_root():
        return
    uid, gid = sandbox_account()
    os.chown(path, uid, gid, follow_symlinks=False)
    for dirpath, dirnames, filenames in walk(path):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)
