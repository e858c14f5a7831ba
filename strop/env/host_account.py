"""The host account a sandbox's user runs as, and the node cache sandboxes read worlds from.

A sandbox's user (`dev`, uid 1000 inside) is one host account: the caller's own when strop runs as
a regular user (bubblewrap can map no other), and the unprivileged `nobody` (SANDBOX_UID) when strop
runs as root, so that host files keep their owners' permissions inside (a root-only file stays
unreadable; mapping to root, the sandbox user owned every root file). Bubblewrap then runs as that
account too, so every host path a sandbox mounts must be reachable by it: the directories strop
makes for worlds are handed to it (`hand_over`), and the node cache lives where it can enter
(`node_cache`).
"""

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from strop.errors import UserError

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


def ready_for_sandbox(world: Path) -> bool:
    """Whether the sandbox account can mount `world` and edit it as its own: always for a regular
    user (it is the sandbox account); as root, a directory handed over (`hand_over`) on a reachable path."""
    if not as_root():
        return True
    return reachable(world) and os.stat(world).st_uid == SANDBOX_UID


def hand_over(path: Path) -> None:
    """Make the tree `path` the sandbox account's (symlinks themselves, never their targets), as
    the files of a repository are its developer's. A no-op when they are ours already."""
    if not as_root():
        return
    uid, gid = sandbox_account()
    os.chown(path, uid, gid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)


def node_cache() -> Path:
    """The per-node cache of images, repositories and the sandbox's Python: $STROP_CACHE, else
    /var/cache/strop as root (root's home is closed to the sandbox account), else
    $XDG_CACHE_HOME/strop or ~/.cache/strop. Created on first use, readable by the sandbox account."""
    if "STROP_CACHE" in os.environ:
        path = Path(os.environ["STROP_CACHE"]).expanduser()
    elif as_root():
        path = Path("/var/cache/strop")
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strop"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if as_root():
            os.chmod(path, 0o755)
    except OSError as e:
        raise UserError(f"cannot create the strop cache {path}: {e.strerror} (set STROP_CACHE)") from None
    if not reachable(path):
        raise UserError(
            f"the strop cache {path} is not reachable by the sandbox account (uid {sandbox_account()[0]}): "
            "set STROP_CACHE to a directory others may enter"
        )
    return path


def cache_dir(kind: str) -> Path:
    """The node cache's directory for one kind of entry (images, repos, downloads, ...), made on
    first use, enterable by the sandbox account."""
    path = node_cache() / kind
    path.mkdir(exist_ok=True)
    os.chmod(path, 0o755)
    return path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the file `path` (made if missing) while the block runs: one process
    builds a cache entry while the others wait, then find it built."""
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def built(dest: Path, build: Callable[[Path], None]) -> Path:
    """The node cache's entry `dest`, made on first use: `build(tmp)` fills a fresh temporary
    directory beside it, renamed into place once complete, under a lock (one builder per entry; the
    others wait and find it built), so a failure leaves nothing half-written."""
    if dest.exists():
        return dest
    with locked(dest.parent / f".{dest.name}.lock"):
        if dest.exists():
            return dest
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".build-"))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)
            os.rename(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


def fetched(url: str) -> Path:
    """The file at an fsspec URL (s3://, gs://, http://, memory://...), fetched once per version into
    the node cache's downloads/ (a version: the size and modification stamp the store reports): how
    every node of a cluster materialises images and repositories from one place."""
    import hashlib

    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        info = fs.info(path)
    except Exception as e:  # any fsspec backend's error: one line for the user
        raise UserError(f"{url!r} cannot be fetched: {_first_line(e)}") from None
    stamp = [str(info.get(k)) for k in ("size", "mtime", "LastModified", "ETag", "etag", "created") if k in info]
    downloads = cache_dir("downloads")
    key = hashlib.sha256("\0".join([url, *stamp]).encode()).hexdigest()[:24]
    dest = downloads / (key + "-" + os.path.basename(url.rstrip("/")))
    if not dest.exists():
        tmp = dest.with_name(dest.name + f".part-{os.getpid()}")
        try:
            with fs.open(path, "rb") as f, open(tmp, "wb") as out:
                shutil.copyfileobj(f, out, 1 << 20)
        except Exception as e:  # any fsspec backend's error: one line for the user
            tmp.unlink(missing_ok=True)
            raise UserError(f"{url!r} cannot be fetched: {_first_line(e)}") from None
        os.rename(tmp, dest)
    return dest


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
