"""Host-side access to a live sandbox's files, and the diff of its copy-on-write layer.

File operations go through a directory fd of the sandbox's root (opened from `/proc/<pid>/root`
once the sandbox is fully set up, and held, so a recycled pid can never redirect it), so the host
sees exactly the merged tree the agent sees. Every path is resolved in that root
(`strop.confined.open_in_root`, openat2 with RESOLVE_IN_ROOT):
absolute symlinks and `..` planted by the agent stay inside the sandbox root instead of
reaching host files (a plain `open("/proc/<pid>/root/...")` would follow `/etc/shadow` on the
host). The diff reads the overlay upper directory directly (it is a host directory): regular
files are additions or edits, character devices 0:0 are whiteouts (deletions), and an opaque
directory hides everything below it in the image. It reads both trees beneath their directories
(`strop.confined.read_beneath`): a link in the repository or in the agent's layer is reported as
its target, never followed (a link to a host file would read it into memory); it walks them
without recursion (`strop.confined.walk`: a workspace may nest directories thousands deep).

Reads and writes refuse anything but regular files (a planted fifo or device cannot block or
flood the host) and reads are bounded. Not covered: special files and xattrs are not reported by
the diff; symlinks are reported as their target path.
"""

import contextlib
import ctypes
import errno
import os
import stat
from pathlib import Path

from strop.confined import lstat_beneath, makedirs_in_root, open_in_root, read_beneath, walk

_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def acting_as(owner: tuple[int, int] | None):
    """This thread's file operations run as `owner` (uid, gid), when set: the files it creates are
    that account's, and an overlay mounted in a user namespace accepts only owners mapped in it
    (root is not: creating a file as root there fails with EOVERFLOW). setfsuid is per thread."""
    if owner is None:
        yield
        return
    old_gid = _libc.setfsgid(owner[1])  # while still root, who may
    old_uid = _libc.setfsuid(owner[0])
    try:
        yield
    finally:
        _libc.setfsuid(old_uid)
        _libc.setfsgid(old_gid)


class RootView:
    """Read, write and list files under `workdir` as seen from inside the sandbox whose root
    directory is open as `root_fd` (the caller owns the fd). With `owner` (uid, gid), writes and
    deletions run as that account (`acting_as`): the sandbox's user, when strop runs as root."""

    def __init__(self, root_fd: int, workdir: str, owner: tuple[int, int] | None = None):
        self.root_fd, self.workdir, self.owner = root_fd, workdir, owner

    def _abs(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.workdir}/{path}"

    def _rootfd(self) -> int:
        return os.dup(self.root_fd)

    def read(self, path: str, max_bytes: int) -> bytes:
        """Bytes of a regular file of at most `max_bytes`. Anything else raises OSError: a fifo or
        device the agent planted must not block or flood the host (O_NONBLOCK, then fstat)."""
        rfd = self._rootfd()
        try:
            fd = open_in_root(rfd, self._abs(path), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        finally:
            os.close(rfd)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", path)
        return data

    def write(self, path: str, data: bytes) -> None:
        with acting_as(self.owner):
            self._write(path, data)

    def remove(self, path: str) -> None:
        """Delete the file (or empty directory) at `path`, the lookup confined like every other;
        a missing path is not an error."""
        with acting_as(self.owner):
            self._remove(path)

    def _write(self, path: str, data: bytes) -> None:
        full = self._abs(path)
        parent, _, name = full.rstrip("/").rpartition("/")
        rfd = self._rootfd()
        try:
            pfd = makedirs_in_root(rfd, parent)
            try:
                # the final component is opened confined too (it may be a symlink the agent planted);
                # O_NONBLOCK: a planted fifo fails (ENXIO) instead of blocking
                fd = open_in_root(rfd, full, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
            finally:
                os.close(pfd)
        finally:
            os.close(rfd)
        with os.fdopen(fd, "wb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            f.write(data)

    def _remove(self, path: str) -> None:
        full = self._abs(path).rstrip("/")
        parent, _, name = full.rpartition("/")
        rfd = self._rootfd()
        try:
            pfd = open_in_root(rfd, parent or "/", os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            return
        finally:
            os.close(rfd)
        try:
            try:
                os.unlink(name, dir_fd=pfd)
            except IsADirectoryError:
                os.rmdir(name, dir_fd=pfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(pfd)

    def list(self, path: str) -> list[str]:
        rfd = self._rootfd()
        try:
            fd = open_in_root(rfd, self._abs(path), os.O_RDONLY | os.O_DIRECTORY)
        finally:
            os.close(rfd)
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str) -> bool:
    for name in ("user.overlay.opaque", "trusted.overlay.opaque"):
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
        except OSError:
            pass
    return False


def _lower_files(lower: Path, rel: str) -> list[str]:
    """Every non-directory path under lower/rel (relative to lower), or rel itself if it is a file;
    nothing reached through a link of the repository (its links are listed, never followed)."""
    st = lstat_beneath(lower, rel)
    if st is None:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [rel]
    out = []
    for dirpath, dirnames, filenames in walk(lower / rel):
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.append(os.path.relpath(os.path.join(dirpath, n), lower))
    return out


def upper_diff(lower: Path, upper: Path) -> dict[str, bytes | None]:
    """Relative path -> new bytes (None = deleted) for files that differ between lower and
    lower+upper. Neither tree is read through a link: the repository's own links (`lower`) and the
    agent's (`upper`) are reported as their targets, never followed to the host."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in walk(upper):
        rel_dir = os.path.relpath(dirpath, upper)
        rel_dir = "" if rel_dir == "." else rel_dir
        if rel_dir and _is_opaque(dirpath):
            for f in _lower_files(lower, rel_dir):
                out[f] = None  # overwritten below if the upper layer re-creates it
        for name in filenames + dirnames:
            full = os.path.join(dirpath, name)
            rel = os.path.join(rel_dir, name)
            try:
                st = os.lstat(full)
            except OSError:  # longer than PATH_MAX: what no path reaches is not reported
                continue
            below = lstat_beneath(lower, rel)
            if _is_whiteout(st):
                for f in _lower_files(lower, rel):
                    out[f] = None
            elif not stat.S_ISDIR(st.st_mode):
                if below is not None and stat.S_ISDIR(below.st_mode):
                    for f in _lower_files(lower, rel):
                        out[f] = None  # a directory in the image replaced by a file
                new = read_beneath(upper, rel)
                if new is not None:
                    out[rel] = new
            elif below is not None and not stat.S_ISDIR(below.st_mode):
                out[rel] = None  # a file in the image replaced by a directory
    # drop copy-ups that changed only metadata, and rewrites to identical bytes
    for rel, new in list(out.items()):
        below = lstat_beneath(lower, rel)
        if (
            new is not None
            and below is not None
            and not stat.S_ISDIR(below.st_mode)
            and read_beneath(lower, rel) == new
        ):
            del out[rel]
        elif new is None and below is None:
            del out[rel]
    return out
