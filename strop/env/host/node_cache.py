"""The node cache: images, repositories, downloads and the sandbox's Python, each made once per node
and shared by every process on it, in a place the sandbox account can enter.

An entry is built in a temporary directory beside it and renamed into place under a lock
(`built`), so a failure leaves nothing half-written and concurrent builders wait for the first.
Entries are named by `strop.memo.content_key` (a truncated sha256 of what decides their content).
"""

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from strop.confined import rmtree
from strop.env.host.account import as_root, reachable, sandbox_account
from strop.errors import UserError
from strop.lifetime import process_gone
from strop.memo import content_key


def is_url(source: str) -> bool:
    """Whether a task's or a config's `repo` or `image` names a URL (fsspec, git over ssh) rather
    than a path on this machine."""
    return "://" in source or source.startswith("git@")


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
    others wait and find it built), so a failure leaves nothing half-written. A builder killed before
    it could clean up leaves its directory (`.build-<pid>-*`): the next build beside it removes it."""
    if dest.exists():
        return dest
    with locked(dest.parent / f".{dest.name}.lock"):
        if dest.exists():
            return dest
        for stale in dest.parent.glob(".build-*-*"):
            if abandoned(stale):
                rmtree(stale)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".build-{os.getpid()}-"))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)
            os.rename(tmp, dest)
        finally:
            if tmp.exists():
                rmtree(tmp)
    return dest


def abandoned(build_dir: Path) -> bool:
    """True for a builder's directory `.build-<pid>-*` whose process is gone."""
    return process_gone(build_dir.name.split("-")[1])


def fetched(url: str) -> Path:
    """The file at an fsspec URL (s3://, gs://, http://, memory://...), fetched once per version into
    the node cache's downloads/ (a version: the size and modification stamp the store reports): how
    every node of a cluster materialises images and repositories from one place."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        info = fs.info(path)
    except Exception as e:  # any fsspec backend's error: one line for the user
        raise UserError(f"{url!r} cannot be fetched: {_first_line(e)}") from None
    stamp = [str(info.get(k)) for k in ("size", "mtime", "LastModified", "ETag", "etag", "created") if k in info]
    downloads = cache_dir("downloads")
    key = content_key(url, *stamp)
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
